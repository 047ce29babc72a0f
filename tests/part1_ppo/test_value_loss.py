"""value_loss: half the mean squared error over the valid tokens, and its clipped form around the old values (the
values, and where the gradient is cut)."""

import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import gradient_sweep_finding, leaf, randn, random_mask, token_factors
from tests.support import assert_close, assert_gradients_match, assert_inputs_unchanged, calling, exercise


@exercise("value_loss")
def test_value_loss(impl):
    mask = random_mask(seed=5)
    values, returns = randn(4, 7, seed=5), randn(4, 7, seed=6)  # junk past EOS: must not count
    assert_close(impl.value_loss(leaf(values), returns, mask), ref.value_loss(leaf(values), returns, mask),
                 "value_loss(values, returns, mask)", mask=mask, factors=token_factors(mask),
                 hint="0.5 * the mean of (values - returns)^2 over the valid tokens")
    same_on_padding = torch.where(mask, returns, values)  # padding contributes 0 to the error
    assert_close(impl.value_loss(leaf(values), same_on_padding, mask),
                 ref.value_loss(leaf(values), same_on_padding, mask),
                 "value_loss where values = returns on padding", mask=mask, factors=token_factors(mask))


@exercise("value_loss")
def test_value_loss_gradient_and_inputs(impl):
    mask = random_mask(seed=7)
    values, returns = randn(4, 7, seed=7), randn(4, 7, seed=8)
    assert_gradients_match(impl.value_loss, ref.value_loss, (values, returns, mask), what="value_loss")
    assert_inputs_unchanged(impl.value_loss, values, returns, mask, what="value_loss")


# --- with a clip around the old values ---------------------------------------------------------------------

def value_clip_inputs(seed):
    """values, returns, old values and a mask: the values have moved about 0.4 from their old values, so a clip of
    0.2 cuts some of them on the side of the return and leaves others."""
    mask = random_mask(seed=seed)
    old_values = randn(4, 7, seed=seed)
    return old_values + 0.4 * randn(4, 7, seed=seed + 1), randn(4, 7, seed=seed + 2), old_values, mask


VALUE_CLIP_HINT = ("with clip, each token's error is max((values - returns)^2, (v_clipped - returns)^2), where "
                   "v_clipped = old_values + clamp(values - old_values, -clip, clip); then 0.5 * its mean over the "
                   "valid tokens")


@exercise("value_loss")
def test_value_loss_clipped(impl):
    for seed, clip in ((11, 0.2), (12, 0.5), (13, 0.0)):
        values, returns, old_values, mask = value_clip_inputs(seed)
        got = calling(impl.value_loss, leaf(values), returns, mask, old_values, clip,
                         what=f"value_loss(values, returns, mask, old_values, clip={clip})")
        assert_close(got, ref.value_loss(leaf(values), returns, mask, old_values, clip),
                     f"value_loss(values, returns, mask, old_values, clip={clip})", mask=mask,
                     factors=token_factors(mask), hint=VALUE_CLIP_HINT)
    values, returns, old_values, mask = value_clip_inputs(14)
    assert_close(impl.value_loss(leaf(values), returns, mask, old_values, None), ref.value_loss(leaf(values), returns,
                 mask), "value_loss(values, returns, mask, old_values, clip=None)", mask=mask,
                 factors=token_factors(mask), hint="without clip the old values are not used: the plain loss")


@exercise("value_loss")
def test_value_loss_clip_cuts_the_gradient_past_the_clip(impl):
    """The gradient of each token over a sweep of values around an old value of 0, for a return above (+1) and one
    below (-1): it must vanish exactly where the value has moved more than clip towards the return."""
    clip = 0.2
    moves = torch.arange(-0.4875, 0.5, 0.025)  # never exactly on a boundary
    values = moves.repeat(2, 1)
    returns = torch.tensor([[1.0], [-1.0]]).expand_as(values).clone()
    old_values, mask = torch.zeros_like(values), torch.ones_like(values, dtype=torch.bool)
    leaves = leaf(values), leaf(values)
    calling(lambda: impl.value_loss(leaves[0], returns, mask, old_values, clip).backward(),
            what="value_loss(..., old_values, clip).backward() over a sweep of values")
    ref.value_loss(leaves[1], returns, mask, old_values, clip).backward()
    got, want = leaves[0].grad, leaves[1].grad
    finding = gradient_sweep_finding(got, want,
                                     lambda i, j: f"value {moves[j]:.4g} with return {1 if i == 0 else -1}")
    assert_close(got, want, "the gradient of the clipped value_loss with respect to values, over values -0.49 .. 0.49 "
                 "around an old value of 0", check_grad=False, finding=finding,
                 hint=f"With old value 0 and clip = {clip}, a token gets no gradient exactly when its value is above "
                      f"{clip} with the return above it, or below {-clip} with the return below it; elsewhere it gets "
                      "(value - return) / (number of valid tokens)")


@exercise("value_loss")
def test_value_loss_clipped_gradient_and_inputs(impl):
    values, returns, old_values, mask = value_clip_inputs(15)
    assert_gradients_match(impl.value_loss, ref.value_loss, (values, returns, mask, old_values, 0.2),
                           what="value_loss with clip=0.2", hint="the old values, like the returns, are constants")
    assert_inputs_unchanged(impl.value_loss, values, returns, mask, old_values, 0.2, what="value_loss with clip=0.2")
