"""clipped_surrogate: PPO's clipped objective against the reference, its default clip, and where its gradient
vanishes over a sweep of ratios."""

import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import gradient_sweep_finding, leaf, randn, random_mask, token_factors
from tests.support import assert_close, assert_gradients_match, assert_inputs_unchanged, calling, exercise


def surrogate_inputs(seed):
    mask = random_mask(seed=seed)
    return randn(4, 7, seed=seed) * 0.3 - 1, randn(4, 7, seed=seed + 1) * 0.3 - 1, randn(4, 7, seed=seed + 2), mask


@exercise("clipped_surrogate")
def test_clipped_surrogate_matches_reference(impl):
    for seed, eps in ((6, 0.2), (7, 0.1), (8, 0.35)):
        lp, old, adv, mask = surrogate_inputs(seed)
        assert_close(impl.clipped_surrogate(leaf(lp), old, adv, mask, eps),
                     ref.clipped_surrogate(leaf(lp), old, adv, mask, eps),
                     f"clipped_surrogate(..., clip_eps={eps})", mask=mask, factors=token_factors(mask))


@exercise("clipped_surrogate")
def test_clipped_surrogate_default_clip(impl):
    lp, old, adv, mask = surrogate_inputs(9)
    assert_close(impl.clipped_surrogate(leaf(lp), old, adv, mask), ref.clipped_surrogate(leaf(lp), old, adv, mask),
                 "clipped_surrogate(logprobs, old_logprobs, advantages, mask) with the default clip_eps", mask=mask,
                 factors=token_factors(mask))


@exercise("clipped_surrogate")
def test_clipped_surrogate_is_flat_outside_the_clip_range(impl):
    old = torch.zeros(1, 6)
    # ratios 1.5, 0.5 (pushed further out by their advantage: flat), 1.1, 0.9 (inside), 0.5, 1.5 (outside, but the
    # advantage pulls them back: the unclipped term counts)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9, 0.5, 1.5]]))
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 6, dtype=torch.bool)
    assert_gradients_match(impl.clipped_surrogate, ref.clipped_surrogate, (lp, old, adv, mask, 0.2),
                           what="clipped_surrogate at ratios [1.5, 0.5, 1.1, 0.9, 0.5, 1.5], advantages [1, -1, 1, -1, "
                                "1, -1]", wrt=["logprobs"])


@exercise("clipped_surrogate")
def test_clipped_surrogate_clip_range(impl):
    """The gradient of each token over a sweep of ratios, for a positive and a negative advantage: it must vanish
    exactly where the ratio is past the clip range in the direction the advantage pushes."""
    eps = 0.2
    ratios = torch.arange(0.5125, 1.5, 0.025)  # never exactly on a boundary
    lp = torch.log(ratios).repeat(2, 1)
    adv = torch.tensor([[1.0], [-1.0]]).expand_as(lp).clone()
    mask = torch.ones_like(lp, dtype=torch.bool)
    leaves = leaf(lp), leaf(lp)
    calling(lambda: impl.clipped_surrogate(leaves[0], torch.zeros_like(lp), adv, mask, eps).backward(),
            what="clipped_surrogate(...).backward() over a sweep of ratios")
    ref.clipped_surrogate(leaves[1], torch.zeros_like(lp), adv, mask, eps).backward()
    got, want = leaves[0].grad, leaves[1].grad
    finding = gradient_sweep_finding(got, want,
                                     lambda i, j: f"ratio {ratios[j]:.4g} with A {'> 0' if i == 0 else '< 0'}")
    assert_close(got, want, "the gradient of clipped_surrogate with respect to logprobs, over ratios 0.51 .. 1.49",
                 check_grad=False, finding=finding,
                 hint=f"With clip_eps = {eps}, a token gets no gradient exactly when A > 0 and ratio > {1 + eps}, or "
                      f"A < 0 and ratio < {1 - eps}; elsewhere it gets A * ratio / (number of valid tokens)")


@exercise("clipped_surrogate")
def test_clipped_surrogate_gradient_and_inputs(impl):
    lp, old, adv, mask = surrogate_inputs(10)
    assert_gradients_match(impl.clipped_surrogate, ref.clipped_surrogate, (lp, old, adv, mask, 0.2),
                           what="clipped_surrogate", wrt=["logprobs", "old_logprobs", "advantages"])
    assert_inputs_unchanged(impl.clipped_surrogate, lp, old, adv, mask, 0.2, what="clipped_surrogate")
