"""The off_policy experiment's exercises: clip_fraction, truncated_importance_weights, tis_grpo_loss (which without
weights is Part 3's grpo_loss), expected_grpo_objective (against the policy gradient over a small two-token space);
the exact comparison's expected gradients against sampled ones and the theory; the experiment in its smoke setting."""

import json
import math

import pytest
import torch
from torch import Tensor

from solutions import part6_lab as ref
from solutions.part3_grpo import grpo_loss
from tests.support import (assert_close, assert_gradients_match, assert_inputs_unchanged, assert_raises, each_refusal,
                           exercise, expect)


# --- clip_fraction -------------------------------------------------------------------------------------------------

def _clip_inputs(seed=0):
    """Ratios [6, 7] around 1 with some exactly on the bounds 0.75, 1.25 and 1.5 (epsilon 0.25, epsilon_high 0.5);
    advantages of both signs and one of exactly 0 (a group whose rewards were all equal); a ragged mask with an
    empty row; and padding whose ratios are far outside every clip range (so counting padding shows)."""
    g = torch.Generator().manual_seed(seed)
    ratio = torch.exp(torch.randn(6, 7, generator=g) * 0.3)
    ratio[0, :5] = torch.tensor([0.75, 1.25, 1.5, 0.5, 0.79])
    ratio[1, :5] = torch.tensor([1.25, 1.5, 0.5, 1.6, 1.21])
    ratio[2, :3] = torch.tensor([0.3, 2.0, 0.6])
    advantages = torch.tensor([-1.0, 0.7, 0.0, -0.3, 1.2, 0.4])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    padding = torch.where(advantages[:, None] < 0, 0.1, 3.0).expand(6, 7)
    return torch.where(mask, ratio, padding), advantages, mask


CLIP_CONFIGS = [(0.2, None), (0.2, 0.28), (0.25, None), (0.25, 0.5), (0.1, 0.0)]
CLIP_HINT = ("The share of the real tokens (mask True) whose gradient the clip takes away: ratio < 1 - epsilon "
             "with A < 0, or ratio > 1 + epsilon_high with A > 0 (strict; epsilon_high None means epsilon); a "
             "token with A = 0 is never counted. Divide by the number of real tokens (at least 1).")


@exercise("clip_fraction")
def test_clip_fraction_matches_reference(impl):
    ratio, advantages, mask = _clip_inputs()
    for epsilon, epsilon_high in CLIP_CONFIGS:
        what = f"clip_fraction(epsilon={epsilon}, epsilon_high={epsilon_high})"
        out = impl.clip_fraction(ratio.clone(), advantages.clone(), mask.clone(), epsilon, epsilon_high)
        assert_close(out, ref.clip_fraction(ratio, advantages, mask, epsilon, epsilon_high), what,
                     factors={"23 (the number of real tokens)": 23.0, "42 (every position)": 42.0,
                              "42/23 (positions over real tokens)": 42 / 23}, hint=CLIP_HINT)


@exercise("clip_fraction")
def test_clip_fraction_counts_each_token_where_the_clip_takes_its_gradient(impl):
    """Each real token alone in the mask: the fraction is 1 exactly when the clip takes that token's gradient."""
    ratio, advantages, mask = _clip_inputs(seed=1)
    for epsilon, epsilon_high in ((0.25, None), (0.25, 0.5)):
        high = epsilon if epsilon_high is None else epsilon_high
        wrong, counted_values = [], set()
        for i, j in mask.nonzero().tolist():
            alone = torch.zeros_like(mask)
            alone[i, j] = True
            got = impl.clip_fraction(ratio.clone(), advantages.clone(), alone, epsilon, epsilon_high)
            want = ref.clip_fraction(ratio, advantages, alone, epsilon, epsilon_high)
            if not (isinstance(got, Tensor) and torch.isclose(got.float(), want.float())):
                is_counted = isinstance(got, Tensor) and got.numel() == 1 and bool(got.float() != 0)
                wrong.append(f"ratio {ratio[i, j].item():.3g} with A = {advantages[i].item():g}: "
                             f"{'counted' if want.item() == 0 else 'not counted'}"
                             + (f" (got {got.item():.4g}, expected 1)" if is_counted and want.item() != 0 else ""))
                if is_counted and want.item() != 0:
                    counted_values.add(round(got.item(), 6))
        which = (f"with the clip range [{1 - epsilon:g}, {1 + high:g}] a token counts exactly when its ratio is below "
                 f"{1 - epsilon:g} with A < 0 or above {1 + high:g} with A > 0 (strictly: a ratio on the bound is not "
                 "clipped), and a token with A = 0 never counts")
        if wrong and len(counted_values) == 1 and all(w.endswith("expected 1)") for w in wrong):
            # every miss is a counted token given the same wrong value: the condition is right, the division is not
            value = counted_values.pop()
            message = (f"the right tokens are counted (nonzero exactly where the clip takes the gradient), but with "
                       f"one real token in the mask a counted token gives {value:.4g}, not 1 (1 counted of 1 real "
                       f"token): the count is divided by {1 / value:.4g} instead of the number of real tokens")
        else:
            message = f"{which}; wrong here: {'; '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}"
        expect(not wrong, f"which tokens clip_fraction(epsilon={epsilon}, epsilon_high={epsilon_high}) counts",
               message, observed=tuple(wrong))


@exercise("clip_fraction")
def test_clip_fraction_is_zero_on_policy_and_without_tokens(impl):
    _, advantages, mask = _clip_inputs()
    ones = torch.ones(6, 7)
    assert_close(impl.clip_fraction(ones, advantages.clone(), mask.clone(), 0.2, 0.28), torch.tensor(0.0),
                 "clip_fraction of ratios that are all 1 (num_iterations 1: the policy has not moved)",
                 hint="A ratio of 1 is inside every clip range: nothing is clipped.")
    ratio, _, _ = _clip_inputs(seed=2)
    got = impl.clip_fraction(ratio, advantages.clone(), torch.zeros_like(mask), 0.2)
    assert_close(got, torch.tensor(0.0), "clip_fraction with no real token at all",
                 hint="No token: 0, not 0/0 = NaN" + (" (divide by the count clamped to at least 1)." if isinstance(
                     got, Tensor) and got.isnan().any() else "."))


@exercise("clip_fraction")
def test_clip_fraction_leaves_inputs_alone_and_refuses_a_negative_epsilon(impl):
    ratio, advantages, mask = _clip_inputs(seed=3)
    assert_inputs_unchanged(impl.clip_fraction, ratio, advantages, mask, 0.2, 0.28, what="clip_fraction")
    with each_refusal():
        for bad in ({"epsilon": -0.1}, {"epsilon_high": -0.1}):
            assert_raises(ValueError, impl.clip_fraction, ratio, advantages, mask, **bad, what=f"clip_fraction({bad})",
                          why="the clip range [1 - epsilon, 1 + epsilon_high] needs epsilons >= 0")


# --- truncated_importance_weights ----------------------------------------------------------------------------------

def _tis_inputs(seed=0):
    """Trainer and sampler log-probs [6, 7] whose log-ratios span [-2, 2] (ratios from 0.14 to 7.4: above every cap
    and below 1/cap), a ragged mask with an empty row, and padding whose log-probs are not 0 (so that forgetting the
    mask shows)."""
    g = torch.Generator().manual_seed(seed)
    sampler = -torch.rand(6, 7, generator=g) * 3 - 0.05
    log_ratio = torch.rand(6, 7, generator=g) * 4 - 2
    log_ratio[0, :4] = torch.tensor([-2.0, -0.8, 0.5, 1.9])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    return (sampler + log_ratio).clamp(max=-0.01), sampler, mask


TIS_HINT = ("Per token: min(exp(trainer_logprobs - sampler_logprobs), cap), i.e. pi_trainer / pi_sampler capped "
            "from above only (a small ratio is kept as it is), detached, and 0 on padding (mask False).")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_match_reference(impl):
    trainer, sampler, mask = _tis_inputs()
    for cap in (2.0, 1.5, 5.0):
        what = f"truncated_importance_weights(cap={cap})"
        out = impl.truncated_importance_weights(trainer.clone(), sampler.clone(), mask.clone(), cap)
        assert_close(out, ref.truncated_importance_weights(trainer, sampler, mask, cap), what, mask=mask,
                     hint=TIS_HINT)


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_are_constants(impl):
    """The weight multiplies a token's loss as a number: no gradient may flow back through it into the trainer."""
    trainer, sampler, mask = _tis_inputs(seed=1)
    leaf = trainer.clone().requires_grad_(True)
    out = impl.truncated_importance_weights(leaf, sampler.clone(), mask.clone())
    assert_close(out, ref.truncated_importance_weights(trainer, sampler, mask), "truncated_importance_weights of "
                 "trainer log-probs that require a gradient", mask=mask, hint=TIS_HINT, gradient_hint="Detach them "
                 "(or compute under torch.no_grad()): in Yao et al.'s estimator the weight is a constant factor of the "
                 "gradient.")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_of_equal_policies_are_one(impl):
    _, sampler, mask = _tis_inputs(seed=2)
    assert_close(impl.truncated_importance_weights(sampler.clone(), sampler.clone(), mask.clone(), 1.5),
                 mask.float(), "truncated_importance_weights when the sampler is the trainer", mask=None,
                 hint="pi_trainer / pi_sampler = 1 on every real token, 0 on padding.")


@exercise("truncated_importance_weights")
def test_truncated_importance_weights_leave_inputs_alone_and_refuse_bad_values(impl):
    trainer, sampler, mask = _tis_inputs(seed=3)
    assert_inputs_unchanged(impl.truncated_importance_weights, trainer, sampler, mask, 3.0,
                            what="truncated_importance_weights")
    with each_refusal():
        assert_raises(ValueError, impl.truncated_importance_weights, trainer, sampler, mask, 0.0,
                      what="truncated_importance_weights(cap=0)", why="a cap must be > 0")
        bad = sampler.clone()
        bad[1, 2] = math.nan
        assert_raises(ValueError, impl.truncated_importance_weights, trainer, bad, mask,
                      what="truncated_importance_weights of sampler log-probs holding a NaN", why="a NaN log-prob")


# --- tis_grpo_loss -------------------------------------------------------------------------------------------------

def _tisl_inputs(seed=0):
    """Log-probs, old log-probs whose ratios fall inside and outside [0.8, 1.28] for advantages of both signs,
    advantages (one 0), a ragged mask with an empty row, and importance weights in [0.1, 2] (not 1 on padding)."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(6, 7, generator=g) * 3 - 0.05
    log_ratio = torch.randn(6, 7, generator=g) * 0.3
    log_ratio[0, :4] = torch.tensor([-0.5, 0.4, math.log(1.25), math.log(0.85)])
    log_ratio[1, :4] = torch.tensor([-0.5, 0.4, math.log(1.25), math.log(0.85)])
    advantages = torch.tensor([1.0, -0.8, 0.5, 0.0, -1.3, 0.9])
    mask = torch.arange(7)[None] < torch.tensor([7, 5, 3, 0, 6, 2])[:, None]
    weights = (torch.rand(6, 7, generator=g) * 1.9 + 0.1)
    return logprobs, logprobs - log_ratio, advantages, mask, weights


LOSS_CONFIGS = [(0.2, None, False, True), (0.2, 0.28, False, True), (0.1, None, True, True),
                (0.2, 0.28, True, True), (0.2, None, False, False), (0.2, 0.28, True, False)]
LOSS_HINT = ("Per token: -min(ratio·A, clip(ratio, 1 - epsilon, 1 + epsilon_high)·A) · weight, ratio = "
             "exp(logprobs - old_logprobs) (old None: logprobs.detach()); the sum over the real tokens divided by "
             "their number, as grpo_loss's 'dapo'. The weight multiplies the clipped term; it is not part of the "
             "ratio.")


def _tisl_what(epsilon, epsilon_high, on_policy, weighted):
    return (f"tis_grpo_loss(epsilon={epsilon}, epsilon_high={epsilon_high}, "
            f"{'old_logprobs=None' if on_policy else 'off-policy'}, {'weights' if weighted else 'weights=None'})")


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_matches_reference(impl):
    logprobs, old, advantages, mask, weights = _tisl_inputs()
    for epsilon, epsilon_high, on_policy, weighted in LOSS_CONFIGS:
        args = (logprobs, None if on_policy else old, advantages, mask, weights if weighted else None, epsilon,
                epsilon_high)
        fresh = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
        assert_close(impl.tis_grpo_loss(*fresh), ref.tis_grpo_loss(*args),
                     _tisl_what(epsilon, epsilon_high, on_policy, weighted),
                     factors={"23 (the number of real tokens)": 23.0}, hint=LOSS_HINT)


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_without_weights_is_grpo_loss(impl):
    """weights=None, or every weight 1, is Part 3's grpo_loss with beta 0 and loss_type 'dapo'."""
    logprobs, old, advantages, mask, _ = _tisl_inputs(seed=1)
    for old_lp in (old, None):
        want = grpo_loss(logprobs, old_lp, None, advantages, mask, epsilon=0.2, epsilon_high=0.28)
        for weights in (None, torch.ones(6, 7)):
            assert_close(impl.tis_grpo_loss(logprobs.clone(), None if old_lp is None else old_lp.clone(),
                                            advantages.clone(), mask.clone(), weights, 0.2, 0.28), want,
                         f"tis_grpo_loss({'weights=None' if weights is None else 'every weight 1'}, "
                         f"{'on' if old_lp is None else 'off'}-policy) against Part 3's grpo_loss",
                         hint="Without weights (or with weights of 1) it is grpo_loss(beta=0, loss_type='dapo').")


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_gradients(impl):
    """The gradient with respect to each token's log-prob is its weight times the unweighted one (-ratio·A/n inside
    the clip range, 0 where the clip binds); none flows into the weights, which are constants."""
    logprobs, old, advantages, mask, weights = _tisl_inputs(seed=2)
    for epsilon, epsilon_high, on_policy, weighted in LOSS_CONFIGS:
        assert_gradients_match(impl.tis_grpo_loss, ref.tis_grpo_loss,
                               (logprobs, None if on_policy else old, advantages, mask,
                                weights if weighted else None, epsilon, epsilon_high),
                               what=_tisl_what(epsilon, epsilon_high, on_policy, weighted),
                               wrt=["logprobs", "weights"] if weighted else ["logprobs"])


@exercise("tis_grpo_loss")
def test_tis_grpo_tisl_leaves_inputs_alone_and_refuses_bad_values(impl):
    logprobs, old, advantages, mask, weights = _tisl_inputs(seed=3)
    for old_lp in (old, None):
        assert_inputs_unchanged(impl.tis_grpo_loss, logprobs, old_lp, advantages, mask, weights, 0.2, 0.28,
                                what=f"tis_grpo_loss({'on' if old_lp is None else 'off'}-policy)")
    with each_refusal():
        assert_raises(ValueError, impl.tis_grpo_loss, logprobs, old, advantages, mask, weights, -0.2,
                      what="tis_grpo_loss(epsilon=-0.2)", why="the clip range needs epsilon >= 0")
        bad = weights.clone()
        bad[0, 1] = math.nan
        assert_raises(ValueError, impl.tis_grpo_loss, logprobs, old, advantages, mask, bad,
                      what="tis_grpo_loss of weights holding a NaN", why="a NaN weight makes the loss NaN")


# --- provided: TRL 1.16's sequence mask, and the sweep's summary -------------------------------------------------

def test_sequence_mask_weights_keep_a_completion_by_its_sequence_ratio_or_mask_it_whole():
    """Hand-made log-ratios (trainer - sampler) per token, four completions of up to 4 tokens, cap 3:
    row 0: 0.5 on each of 4 tokens: sum 2.0, ratio e^2 = 7.39 > 3: masked (a mean of the log-ratios, 0.5, would have
    kept it at e^0.5 = 1.65); row 1: 0.3, 0.2, 0.0 and padding: ratio e^0.5 = 1.65, on each real token (not 1);
    row 2: -1 on 3 tokens: ratio e^-3 = 0.05, kept (no lower bound by default); row 3: 0.4 on 2 tokens and huge
    log-ratios on its padding, which must not count: ratio e^0.8 = 2.23, kept."""
    log_ratio = torch.tensor([[0.5, 0.5, 0.5, 0.5], [0.3, 0.2, 0.0, 9.0], [-1.0, -1.0, -1.0, 0.0],
                              [0.4, 0.4, 50.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    sampler = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0)) - 0.5
    trainer = (sampler + log_ratio).requires_grad_()
    weights = ref.sequence_mask_weights(trainer, sampler, mask, 3.0)
    kept = torch.tensor([0.0, math.exp(0.5), math.exp(-3.0), math.exp(0.8)])
    assert_close(weights, torch.where(mask, kept[:, None], 0.0), "sequence_mask_weights(cap=3)",
                 hint="The sequence ratio is exp(sum of the real tokens' log-ratios); above the cap the whole "
                      "completion gets 0, else every real token gets the ratio itself; padding gets 0.")
    assert not weights.requires_grad, "the weights are constants: no gradient may flow through them"
    assert torch.equal(ref.sequence_mask_weights(trainer, sampler, mask, 10.0)[0], torch.full((4,), math.exp(2.0))), \
        "with cap 10 the first completion (ratio e^2) is kept, weighted by its ratio"
    equal = ref.sequence_mask_weights(sampler, sampler, mask, 3.0)
    assert torch.equal(equal, mask.float()), "a sampler equal to the trainer weighs every real token 1"
    assert_raises(ValueError, ref.sequence_mask_weights, trainer, sampler, mask, 0.0,
                  what="sequence_mask_weights(cap=0)", why="the cap must be positive")


# --- expected_grpo_objective ----------------------------------------------------------------------------------------

def _ego_inputs(seed=0, completions=7, gen=3):
    """probs of 7 completions (count / N of 32 draws: one 0), log-probs [7, 3], old log-probs whose ratios fall
    inside and outside [0.8, 1.28] for advantages of both signs, advantages (one 0), weights in [0.1, 2]."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor([5.0, 0.0, 9.0, 3.0, 7.0, 2.0, 6.0])[:completions] / 32
    logprobs = -torch.rand(completions, gen, generator=g) * 3 - 0.05
    log_ratio = torch.randn(completions, gen, generator=g) * 0.3
    log_ratio[0] = torch.tensor([-0.5, 0.4, math.log(1.25)])[:gen]
    log_ratio[2] = torch.tensor([-0.5, 0.4, math.log(0.85)])[:gen]
    advantages = torch.tensor([1.0, -0.8, -0.6, 0.0, 0.7, -1.3, 0.9])[:completions]
    weights = torch.rand(completions, gen, generator=g) * 1.9 + 0.1
    return probs, logprobs, logprobs - log_ratio, advantages, weights


EGO_CONFIGS = [(0.2, None, False, True), (0.2, 0.28, False, True), (0.1, None, True, True),
               (0.2, 0.28, True, False), (0.2, 0.0, False, False), (0.25, 0.5, False, False)]
EGO_HINT = ("Per completion y: probs[y] times the sum over its tokens of weight · min(ratio·A(y), clip(ratio, "
            "1 - epsilon, 1 + epsilon_high)·A(y)), ratio = exp(logprobs - old) (old None: logprobs.detach()); then "
            "the sum over the completions. An objective to maximise (no minus sign), summed (not averaged) over "
            "tokens and completions; probs and weights are constants.")


def _ego_what(epsilon, epsilon_high, on_policy, weighted):
    return (f"expected_grpo_objective(epsilon={epsilon}, epsilon_high={epsilon_high}, "
            f"{'old_logprobs=None' if on_policy else 'off-policy'}, {'weights' if weighted else 'weights=None'})")


@exercise("expected_grpo_objective")
def test_expected_grpo_objective_matches_reference(impl):
    probs, logprobs, old, advantages, weights = _ego_inputs()
    for epsilon, epsilon_high, on_policy, weighted in EGO_CONFIGS:
        args = (probs, logprobs, None if on_policy else old, advantages, weights if weighted else None, epsilon,
                epsilon_high)
        fresh = tuple(a.clone() if isinstance(a, Tensor) else a for a in args)
        assert_close(impl.expected_grpo_objective(*fresh), ref.expected_grpo_objective(*args),
                     _ego_what(epsilon, epsilon_high, on_policy, weighted),
                     factors={"3 (tokens per completion)": 3.0, "7 (completions)": 7.0, "21 (tokens)": 21.0},
                     hint=EGO_HINT)


@exercise("expected_grpo_objective")
def test_expected_grpo_objective_gradients(impl):
    """The gradient with respect to each token's log-prob is probs[y] · weight · ratio · A(y) inside the clip range
    and 0 where the clip binds; none flows into probs or the weights."""
    probs, logprobs, old, advantages, weights = _ego_inputs(seed=1)
    for epsilon, epsilon_high, on_policy, weighted in EGO_CONFIGS:
        assert_gradients_match(impl.expected_grpo_objective, ref.expected_grpo_objective,
                               (probs, logprobs, None if on_policy else old, advantages,
                                weights if weighted else None, epsilon, epsilon_high),
                               what=_ego_what(epsilon, epsilon_high, on_policy, weighted),
                               wrt=["probs", "logprobs", "weights"] if weighted else ["probs", "logprobs"])


VOCAB = 5


def _two_token_space(seed=0, shift=0.8):
    """A policy over the 25 two-token completions of a 5-token vocabulary (as the lab's over the tiny model's 356²):
    its logits, leaves that take the gradient (the first token [5]; the second given the first [5, 5]); a sampler's
    logits, the policy's plus noise of std `shift`; a reward of 0 or 1 on each completion."""
    g = torch.Generator().manual_seed(seed)
    first = torch.randn(VOCAB, generator=g).requires_grad_()
    second = torch.randn(VOCAB, VOCAB, generator=g).requires_grad_()
    sampler = (first.detach() + shift * torch.randn(VOCAB, generator=g),
               second.detach() + shift * torch.randn(VOCAB, VOCAB, generator=g))
    rewards = (torch.rand(VOCAB * VOCAB, generator=g) < 0.5).float()
    return first, second, sampler, rewards


def _table(first_logits, second_logits):
    """[25, 2]: completion (a, b) is row 5a + b, with log pi(a) and log pi(b | a)."""
    first, second = first_logits.log_softmax(-1), second_logits.log_softmax(-1)
    return torch.stack([first[:, None].expand(VOCAB, VOCAB), second], -1).reshape(VOCAB * VOCAB, 2)


def _flat_gradient(value, leaves):
    grads = torch.autograd.grad(value, leaves, allow_unused=True, retain_graph=True)
    return torch.cat([(g if g is not None else torch.zeros_like(x)).flatten() for g, x in zip(grads, leaves)])


def _gradient_of(value, leaves, what):
    """The gradient of a learner's scalar with respect to the logits, after checking that one flows at all."""
    carries = isinstance(value, Tensor) and value.requires_grad
    expect(carries, what, "no gradient flows back to the policy's logits through the returned value",
           observed="no gradient" if not carries else None)
    return _flat_gradient(value, leaves)


def _policy_gradient(first, second, rewards):
    """The true gradient of E_pi[reward], by autograd on the sum over all 25 completions."""
    return _flat_gradient((_table(first, second).sum(1).exp() * rewards).sum(), [first, second])


POLICY_GRADIENT_HINT = ("The gradient of sum_y sg(probs[y]) · L(y) is sum_y probs[y] · grad L(y): the sampling is "
                        "not differentiated, so probs must be detached. On-policy (probs = pi, ratio 1) that is sum_y "
                        "pi(y) A(y) grad log pi(y) = grad E_pi[reward].")


@exercise("expected_grpo_objective")
def test_expected_grpo_objective_on_policy_is_the_policy_gradient(impl):
    """With probs = pi(y), the ratio 1 (old None, or the policy's own log-probs as old) and A = r - E_pi[r], the
    gradient is the true gradient of E_pi[r], over every completion of a small two-token space. probs is passed as
    the policy computes it, with its gradient: the function must not differentiate the sampling."""
    for seed in (0, 1):
        first, second, _, rewards = _two_token_space(seed)
        table = _table(first, second)
        pi = table.sum(1).exp()
        advantages = rewards - (pi.detach() * rewards).sum()
        want = _policy_gradient(first, second, rewards)
        for old, name in ((None, "old_logprobs=None"), (table.detach(), "old_logprobs = the policy's own")):
            what = f"the gradient of expected_grpo_objective(probs=pi, {name}) (seed {seed})"
            got = _gradient_of(impl.expected_grpo_objective(pi, table, old, advantages, None, 0.2, 0.28),
                               [first, second], what)
            assert_close(got, want, what, hint=POLICY_GRADIENT_HINT)


@exercise("expected_grpo_objective")
def test_expected_grpo_objective_of_the_sequence_ratio_is_the_policy_gradient(impl):
    """Completions drawn from a sampler, each token weighted by the completion's pi(y) / pi_sampler(y) and A = r -
    E_sampler[r]: the expected gradient is still the true gradient of E_pi[r] (importance sampling over sequences is
    unbiased; the baseline is a constant, whose term has expectation 0 under pi)."""
    first, second, (sampler_first, sampler_second), rewards = _two_token_space(seed=2)
    table = _table(first, second)
    sampler = _table(sampler_first, sampler_second)
    mu = sampler.sum(1).exp()
    ratio = (table.detach().sum(1) - sampler.sum(1)).exp()
    what = "the gradient of expected_grpo_objective(probs=sampler, weights=pi(y) / pi_sampler(y))"
    got = _gradient_of(impl.expected_grpo_objective(mu, table, None, rewards - (mu * rewards).sum(),
                                                    ratio[:, None].expand(-1, 2), 0.2, 0.28), [first, second], what)
    assert_close(got, _policy_gradient(first, second, rewards), what, hint=POLICY_GRADIENT_HINT)


@exercise("expected_grpo_objective")
def test_expected_grpo_objective_with_the_sampler_as_old_is_token_importance_sampling_inside_the_clip(impl):
    """The sampler's log-probs as old: ratio pi_t / pi_sampler,t with its gradient, which is ratio · grad log pi_t.
    With a clip range that no ratio leaves (epsilon 1, epsilon_high 1e6) that is the same gradient as weights
    pi_t / pi_sampler,t on the unclipped, old-None objective (uncapped per-token importance sampling)."""
    first, second, (sampler_first, sampler_second), rewards = _two_token_space(seed=3)
    table = _table(first, second)
    sampler = _table(sampler_first, sampler_second)
    mu = sampler.sum(1).exp()
    advantages = rewards - (mu * rewards).sum()
    what = "the gradient of expected_grpo_objective(old_logprobs=sampler's, epsilon=1, epsilon_high=1e6)"
    got = _gradient_of(impl.expected_grpo_objective(mu, table, sampler, advantages, None, 1.0, 1e6), [first, second],
                       what)
    want = _flat_gradient(ref.expected_grpo_objective(mu, table, None, advantages, (table.detach() - sampler).exp()),
                          [first, second])
    assert_close(got, want, what, hint="ratio = exp(logprobs - old_logprobs) keeps its gradient through logprobs "
                                       "(only old is a constant): d ratio = ratio · d log pi.")


@exercise("expected_grpo_objective")
def test_expected_grpo_objective_leaves_inputs_alone_and_refuses_bad_values(impl):
    probs, logprobs, old, advantages, weights = _ego_inputs(seed=3)
    for old_lp in (old, None):
        assert_inputs_unchanged(impl.expected_grpo_objective, probs, logprobs, old_lp, advantages, weights, 0.2, 0.28,
                                what=f"expected_grpo_objective({'on' if old_lp is None else 'off'}-policy)")
    with each_refusal():
        assert_raises(ValueError, impl.expected_grpo_objective, probs, logprobs, old, advantages, weights, -0.2,
                      what="expected_grpo_objective(epsilon=-0.2)", why="the clip range needs epsilon >= 0")
        bad = probs.clone()
        bad[2] = math.nan
        assert_raises(ValueError, impl.expected_grpo_objective, bad, logprobs, old, advantages, weights,
                      what="expected_grpo_objective of probs holding a NaN", why="a NaN probability makes the sum NaN")


# --- the exact comparison: expectations against samples, and the theory --------------------------------------------

def _sampled_gradient(off_policy, name, first, second, sampler, rewards, n, generator):
    """What n completions drawn from the sampler give: the sweep's own loss (tis_grpo_loss, with the weights or old
    log-probs of correction_terms) on the drawn batch, its gradient as an objective summed over a completion's two
    tokens (tis_grpo_loss averages over the 2n tokens: times -2), A = r - E_sampler[r]."""
    table = _table(first, second)
    mu = sampler.sum(1).exp()
    draws = off_policy._draw(mu, n, generator)  # the same draws on any number of threads
    logprobs, sampler_lp = table[draws], sampler[draws]
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    old, weights = off_policy.correction_terms(name, logprobs.detach(), sampler_lp, mask,
                                               truncated_importance_weights=ref.truncated_importance_weights)
    loss = ref.tis_grpo_loss(logprobs, old, rewards[draws] - (mu * rewards).sum(), mask, weights, 0.2, 0.28)
    return _flat_gradient(-2 * loss, [first, second])


def _exact_gradient(off_policy, name, first, second, sampler, rewards):
    """The experiment's exact expected gradient of `name` under the sampler (expected_grpo_objective over all 25)."""
    table = _table(first, second)
    mu = sampler.sum(1).exp()
    mask = torch.ones_like(table, dtype=torch.bool)
    old, weights = off_policy.correction_terms(name, table.detach(), sampler, mask,
                                               truncated_importance_weights=ref.truncated_importance_weights)
    return _flat_gradient(ref.expected_grpo_objective(mu, table, old, rewards - (mu * rewards).sum(), weights, 0.2,
                                                      0.28), [first, second])


def _sampling_error(off_policy, name, first, second, sampler, rewards, n):
    """The root-mean-square distance between an n-sample gradient and its expectation: sqrt((E||g(y)||^2 -
    ||E g(y)||^2) / n), with each completion's own gradient g(y) (probs one-hot on y), exactly over all 25."""
    table = _table(first, second)
    mu = sampler.sum(1).exp()
    mask = torch.ones_like(table, dtype=torch.bool)
    old, weights = off_policy.correction_terms(name, table.detach(), sampler, mask,
                                               truncated_importance_weights=ref.truncated_importance_weights)
    advantages = rewards - (mu * rewards).sum()
    each = torch.stack([_flat_gradient(ref.expected_grpo_objective(torch.eye(len(mu))[y], table, old, advantages,
                                                                   weights, 0.2, 0.28), [first, second])
                        for y in range(len(mu))])                                               # [25, parameters]
    mean = (mu[:, None] * each).sum(0)
    return math.sqrt(((mu * each.pow(2).sum(1)).sum() - mean.pow(2).sum()).clamp(min=0).item() / n)


def test_each_corrections_exact_gradient_is_the_mean_of_its_sampled_gradients():
    """For every correction of the exact comparison, the expected gradient computed over all 25 completions agrees
    with the gradient of the sweep's loss on 100,000 completions drawn from the sampler (a fixed seed: the same draws
    every run) to within 3 times the sampling error (the root-mean-square distance such an estimate has from its
    expectation, computed exactly); and each correction but the sequence ratio is more than 10 sampling errors from
    the on-policy gradient, so the agreement is not the tolerance's."""
    from solutions.part6_lab import off_policy

    first, second, sampler_logits, rewards = _two_token_space(seed=4)
    sampler = _table(*sampler_logits)
    on_policy = _policy_gradient(first, second, rewards)
    generator = torch.Generator().manual_seed(0)
    n = 100_000
    for name in off_policy.EXACT_CORRECTIONS:
        exact = _exact_gradient(off_policy, name, first, second, sampler, rewards)
        sampled = _sampled_gradient(off_policy, name, first, second, sampler, rewards, n, generator)
        noise = _sampling_error(off_policy, name, first, second, sampler, rewards, n)
        error = (sampled - exact).norm().item()
        assert error < 3 * noise, f"{name}: the sampled gradient is {error:.3g} from the exact one (noise {noise:.3g})"
        if name != "sequence_ratio":  # the one correction whose expectation is the on-policy gradient
            bias = (exact - on_policy).norm().item()
            assert bias > 10 * noise, f"{name}: {bias:.3g} from the on-policy gradient, noise {noise:.3g}"


def test_with_the_sampler_equal_to_the_policy_every_correction_is_on_policy():
    """Sampler = policy: every weight is 1, every ratio 1 inside the clip, so every correction's expected gradient is
    the true gradient of E_pi[r]."""
    from solutions.part6_lab import off_policy

    first, second, _, rewards = _two_token_space(seed=5)
    policy = _table(first, second).detach()
    want = _policy_gradient(first, second, rewards)
    for name in off_policy.EXACT_CORRECTIONS:
        got = _exact_gradient(off_policy, name, first, second, policy, rewards)
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), f"{name}: {got} against {want}"


def test_the_sequence_ratio_is_unbiased_and_per_token_weights_follow_the_theory():
    """Over the sequence, pi(y) / pi_sampler(y) gives the on-policy gradient exactly. Per token, uncapped, it gives
    sum_a pi(a) E_{b ~ sampler(.|a)}[A] grad log pi(a) + sum_a sampler(a) sum_b pi(b|a) A grad log pi(b|a): each
    token's draw corrected given its prefix, the later token and the prefix still the sampler's. Not the on-policy
    gradient."""
    from solutions.part6_lab import off_policy

    first, second, sampler_logits, rewards = _two_token_space(seed=6)
    sampler = _table(*sampler_logits)
    on_policy = _policy_gradient(first, second, rewards)
    assert torch.allclose(_exact_gradient(off_policy, "sequence_ratio", first, second, sampler, rewards), on_policy,
                          atol=1e-6, rtol=1e-5)
    first_lp, second_lp = first.log_softmax(-1), second.log_softmax(-1)
    mu_first, mu_second = sampler_logits[0].softmax(-1), sampler_logits[1].softmax(-1)   # [5], [5, 5]
    advantages = (rewards - (sampler.sum(1).exp() * rewards).sum()).view(VOCAB, VOCAB)
    later = (mu_second * advantages).sum(1)                                                # E_{b ~ sampler(.|a)}[A]
    theory = ((first_lp.exp() * later).detach() * first_lp).sum() + \
        ((mu_first[:, None] * second_lp.exp() * advantages).detach() * second_lp).sum()
    per_token = _exact_gradient(off_policy, "tis_token_uncapped", first, second, sampler, rewards)
    assert torch.allclose(per_token, _flat_gradient(theory, [first, second]), atol=1e-6, rtol=1e-5)
    assert ((per_token - on_policy).norm() / on_policy.norm()).item() > 0.1, "per-token IS is biased here"


@pytest.mark.slow
def test_the_exact_comparison_on_the_tiny_model(tiny_model):
    """On the tiny model, every two-token completion of a prompt: with the sampler equal to the policy every
    correction's expected gradient is the on-policy one; with a stale sampler (one seed of exact_seed) the sampler
    reaches its gap, the sequence ratio's expected gradient is the on-policy one (cosine 1, norm ratio 1) and every
    other correction's is not, and the shares it reports are shares."""
    from solutions.part6_lab import kl_gradients, off_policy

    lora_model = kl_gradients._policy(tiny_model, 0, kl_gradients.Settings(b_std=0.5))
    try:
        vocab = tiny_model.cfg.d_vocab
        tokenizer = tiny_model.tokenizer
        prompt = torch.tensor([tokenizer.bos_token_id] + tokenizer("53+", add_special_tokens=False).input_ids)
        table = off_policy._completions(*ref.two_token_logprobs(lora_model, prompt), torch.arange(vocab),
                                        torch.arange(vocab * vocab))
        params = list(lora_model.adapters.parameters())
        pi = table.detach().sum(1).exp()
        rewards = (torch.rand(vocab * vocab, generator=torch.Generator().manual_seed(0)) < 0.5).float()
        advantages = rewards - (pi * rewards).sum()
        on_policy = _flat_gradient(ref.expected_grpo_objective(pi, table, None, advantages), params)
        mask = torch.ones_like(table, dtype=torch.bool)
        for name in off_policy.EXACT_CORRECTIONS:
            old, weights = off_policy.correction_terms(name, table.detach(), table.detach(), mask,
                                                       truncated_importance_weights=ref.truncated_importance_weights)
            got = _flat_gradient(ref.expected_grpo_objective(pi, table, old, advantages, weights), params)
            assert ((got - on_policy).norm() / on_policy.norm()).item() < 1e-5, name
    finally:
        tiny_model.reset_hooks()
    exact = off_policy.Exact(gaps=(0.3,), sample_sizes=(8, 64), repeats=1)
    run = off_policy.exact_seed(tiny_model, 0, exact, expected_grpo_objective=ref.expected_grpo_objective,
                                truncated_importance_weights=ref.truncated_importance_weights)
    level = run["levels"][0]
    assert abs(level["gap"] / 0.3 - 1) < 0.05, level["gap"]
    for name, c in level["corrections"].items():
        if name == "sequence_ratio":
            assert c["cosine"] > 1 - 1e-5 and abs(c["norm_ratio"] - 1) < 1e-4, c
        else:
            assert c["cosine"] < 0.999, (name, c)
    assert all(0 <= v <= 1 for k, v in level["sampler_as_old"].items() if k not in ("above_part_norm",
                                                                                     "max_ratio_above")), level
    assert set(run["noise"]) == {"on_policy", *off_policy.EXACT_CORRECTIONS}
    assert all(len(run["noise"][name][n]) == 1 for name in run["noise"] for n in (8, 64))


def test_accuracy_auc_is_the_mean_accuracy_over_the_steps():
    """Trapezoids between evaluations, divided by the steps they span: a constant curve gives the constant, a ramp
    its midpoint, and uneven spacing weights each stretch by its length."""
    from solutions.part6_lab.off_policy import accuracy_auc

    assert accuracy_auc([0, 4, 8], [0.5, 0.5, 0.5]) == pytest.approx(0.5)
    assert accuracy_auc([0, 10], [0.2, 0.6]) == pytest.approx(0.4)
    assert accuracy_auc([0, 2, 10], [0.0, 1.0, 1.0]) == pytest.approx((2 * 0.5 + 8 * 1.0) / 10)
    assert accuracy_auc([0], [0.3]) == pytest.approx(0.3)


def _fake_result(off_policy, seeds=(0, 1)):
    """A result as run() returns it, with made-up logs: the sweep's AUC is 0.5 - 0.01 * lag + 0.001 * seed."""
    sweep = off_policy.Sweep(steps=4, eval_every=2)
    log = lambda auc: {"auc": auc, "accuracy": [0.4, auc], "gap": [0.1], "sequences_over_3": [0.0],  # noqa: E731
                       "above_against": [0.0], "grad_norm": [1.0]}
    gap = {name: {"max": 1.0, "mean": 0.1} for name in off_policy.SAMPLERS}
    return {"seeds": list(seeds), "smoke": True, "sweep_settings": sweep,
            "clip": {1: [{"clip": [[0.0]], "reward": [0.5]} for _ in seeds]}, "gap": [gap for _ in seeds],
            "sweep": {c: {lag: [log(0.5 - 0.01 * lag + 0.001 * s) for s in seeds] for lag in sweep.lags}
                      for c in sweep.corrections},
            "exact_settings": off_policy.SMOKE_EXACT, "exact": [_fake_exact(off_policy, s) for s in seeds]}


def _fake_exact(off_policy, seed):
    """exact_seed's result with made-up figures: the cosine of correction i at gap k is 1 - 0.1 * i * k - 0.01 *
    seed, its norm ratio 1 + i."""
    names = ("on_policy",) + tuple(off_policy.EXACT_CORRECTIONS)
    level = lambda k, gap: {"gap": gap, "target": gap, "sigma": 0.1, "kl": 0.5,  # noqa: E731
                            "corrections": {c: {"cosine": 1 - 0.1 * i * k - 0.01 * seed, "norm_ratio": 1.0 + i}
                                            for i, c in enumerate(off_policy.EXACT_CORRECTIONS)},
                            "sampler_as_old": {"clipped": 0.1, "outside_against": 0.2,
                                               "above_with_negative_advantage": 0.05, "above_part_norm": 0.5,
                                               "max_ratio_above": 10.0 + seed}}
    return {"seed": seed, "prompt": "53+", "reward_on_policy": 0.5,
            "levels": [level(k, gap) for k, gap in enumerate(off_policy.SMOKE_EXACT.gaps)],
            "noise": {name: {n: [(0.5, 0.6)] for n in off_policy.SMOKE_EXACT.sample_sizes} for name in names}}


def test_the_sweep_summary_has_one_entry_per_lag_and_correction():
    from solutions.part6_lab import off_policy

    figures = off_policy.summarize(_fake_result(off_policy))
    cells = [(e["lag"], e["correction"]) for e in figures["sweep"]]
    want = [(lag, c) for lag in off_policy.SWEEP.lags for c in off_policy.CORRECTIONS]
    assert sorted(cells) == sorted(want) and len(cells) == len(set(cells)) == 30, cells
    assert set(off_policy.SWEEP.lags) == {0, 1, 2, 4, 8}
    assert set(off_policy.CORRECTIONS) == {"none", "tis_token_cap1", "tis_token_cap2", "tis_token_cap5",
                                           "sequence_mask_cap3", "sampler_as_old"}
    for entry in figures["sweep"]:
        per_seed = [0.5 - 0.01 * entry["lag"] + 0.001 * s for s in (0, 1)]
        assert entry["auc_per_seed"] == pytest.approx(per_seed), entry
        assert entry["auc"] == pytest.approx(sum(per_seed) / 2) and entry["std"] > 0, entry
        assert entry["auc_minus_none"] == pytest.approx([0.0, 0.0]), "the same AUC as the uncorrected run"
    assert figures["lag0_auc_spread"] == pytest.approx(0.0)


def test_the_summary_states_paired_differences_and_whether_each_is_resolved():
    """Every comparison the text makes is a difference paired by seed, with its standard error and whether its 95%
    t-interval over the seeds excludes 0: here tis_token_cap2 - tis_token_cap1 is 0.02, 0.03, 0.04 over three seeds
    at every lag (mean 0.03, standard error 0.0058, interval 0.005 to 0.055: resolved), and every cell's difference
    from the uncorrected run and from the on-policy run of the same seed is reported the same way."""
    from solutions.part6_lab import off_policy

    result = _fake_result(off_policy, seeds=(0, 1, 2))
    for lag, runs in result["sweep"]["tis_token_cap2"].items():
        for seed, run in enumerate(runs):
            run["auc"] = result["sweep"]["tis_token_cap1"][lag][seed]["auc"] + 0.02 + 0.01 * seed
    figures = off_policy.summarize(result)
    pairs = [p for p in figures["paired"] if (p["a"], p["b"]) == ("tis_token_cap2", "tis_token_cap1")]
    assert [p["lag"] for p in pairs] == [1, 2, 4, 8]
    for p in pairs:
        se = 0.01 / math.sqrt(3)
        assert p["mean"] == pytest.approx(0.03) and p["standard_error"] == pytest.approx(se, abs=1e-4)
        assert p["ci95"] == pytest.approx([0.03 - 4.303 * se, 0.03 + 4.303 * se], abs=2e-4) and p["resolved"], p
    assert {(p["a"], p["b"]) for p in figures["paired"]} == set(off_policy.PAIRS)
    for entry in figures["sweep"]:
        if entry["lag"] == 0:
            assert "minus_none" not in entry and "minus_on_policy" not in entry
            continue
        # against lag 0 of the first correction, "none": -0.01 per step of lag, and cap 2's own 0.02 + 0.01 * seed
        on_policy = -0.01 * entry["lag"] + (0.03 if entry["correction"] == "tis_token_cap2" else 0.0)
        assert entry["minus_on_policy"]["mean"] == pytest.approx(on_policy, abs=1e-6), entry
        if entry["correction"] == "tis_token_cap2":  # 0.02 +- 0.0058 at lag 1: its interval holds 0; -0.04 at lag 8
            assert entry["minus_on_policy"]["resolved"] == (entry["lag"] == 8), entry
        assert set(entry["minus_none"]) >= {"mean", "standard_error", "ci95", "resolved"}, entry


def test_the_exact_summary_has_one_entry_per_correction():
    """`exact`: at least 7 entries, one per correction of EXACT_CORRECTIONS, with its cap (None: uncapped or not a
    weight), the cosine and norm ratio at the largest gap (means over seeds), and the same at every gap."""
    from solutions.part6_lab import off_policy

    figures = off_policy.summarize(_fake_result(off_policy))
    entries = figures["exact"]
    assert [e["correction"] for e in entries] == list(off_policy.EXACT_CORRECTIONS) and len(entries) >= 7
    caps = {e["correction"]: e["cap"] for e in entries}
    assert caps == {"none": None, "tis_token_cap1": 1.0, "tis_token_cap2": 2.0, "tis_token_cap5": 5.0,
                    "tis_token_uncapped": None, "sequence_ratio": None, "sequence_mask_cap3": 3.0,
                    "sampler_as_old": None}
    last = len(off_policy.SMOKE_EXACT.gaps) - 1
    for i, entry in enumerate(entries):
        assert set(entry) >= {"correction", "cap", "cosine", "norm_ratio", "by_gap", "noise"}, entry
        assert entry["cosine"] == pytest.approx(1 - 0.1 * i * last - 0.005, abs=1e-4), entry  # seeds 0 and 1
        assert entry["norm_ratio"] == pytest.approx(1.0 + i)
        assert [g["gap"] for g in entry["by_gap"]] == list(off_policy.SMOKE_EXACT.gaps)
        assert entry["noise"]["cosine_on_policy"] == pytest.approx([0.5] * len(off_policy.SMOKE_EXACT.sample_sizes))
    assert figures["exact_sampler_as_old"][-1]["max_ratio_above"] == pytest.approx(11.0)
    json.dumps(figures)  # what the script prints


def test_a_sweep_refuses_an_unknown_correction():
    from solutions.part6_lab import off_policy

    with pytest.raises(ValueError, match="unknown corrections"):
        off_policy.Sweep(corrections=("none", "tis_cap2"))


# --- the experiment, in its smoke setting --------------------------------------------------------------------------

@pytest.mark.slow
def test_off_policy_experiment_runs_and_summarizes():
    from solutions.part6_lab import off_policy

    result = off_policy.run(seeds=[0], smoke=True)
    figures = off_policy.summarize(result)
    assert set(figures) >= {"clip_fraction", "gap", "sweep", "lag0_auc_spread"}, figures
    assert figures["clip_fraction"]["1"]["mean"] == 0.0, "num_iterations 1: the ratio is 1, nothing is clipped"
    assert figures["gap"]["lean float32"]["max"] < 1e-3 < figures["gap"][off_policy.SAMPLERS[-1]]["mean"], figures
    cells = {(e["lag"], e["correction"]) for e in figures["sweep"]}
    assert cells == {(lag, c) for lag in off_policy.SMOKE_SWEEP.lags for c in off_policy.CORRECTIONS}, cells
    for entry in figures["sweep"]:
        assert set(entry) >= {"lag", "correction", "auc", "std", "auc_per_seed"}, entry
        assert 0.0 <= entry["auc"] <= 1.0, entry
        if entry["lag"] == 0:  # the sampler is the trainer up to float rounding
            assert entry["gap_mean"] < 1e-4, entry
    # at lag 0 every correction is (nearly) the identity: the six runs agree to a held-out answer or two
    assert figures["lag0_auc_spread"] <= 0.05, figures["lag0_auc_spread"]
    off_policy.plot(result)


def test_the_default_sweep_trains_lag_0_once_and_reports_it_under_every_correction(monkeypatch):
    """share_lag0: at lag 0 every correction trains the same run (the smoke sweep, which trains each, checks they
    agree), so the default trains it once per seed and reports that run under each correction; the lag-0 check then
    has nothing to compare (None), never a made-up 0."""
    from solutions.part6_lab import off_policy

    trained = []

    def fake_run_sweep(seed, lag, correction, *args, **kwargs):
        trained.append((lag, correction, seed))
        return {"auc": 0.5 + 0.01 * lag + 0.001 * seed, "accuracy": [0.4, 0.5], "gap": [0.1],
                "sequences_over_3": [0.0], "above_against": [0.0], "grad_norm": [1.0]}, None, None

    monkeypatch.setattr(off_policy, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(off_policy, "measure_gaps", lambda *args: {name: {"max": 1.0, "mean": 0.1}
                                                                   for name in off_policy.SAMPLERS})
    monkeypatch.setattr(off_policy, "run_clip", lambda *args, **kwargs: {"clip": [[0.0]], "reward": [0.5]})
    monkeypatch.setattr(off_policy, "exact_seed", lambda base, seed, *args, **kwargs: _fake_exact(off_policy, seed))
    sweep = off_policy.Sweep(lags=(0, 2), steps=2, share_lag0=True)
    result = off_policy.run([0, 1], smoke=True, sweep=sweep)
    first = sweep.corrections[0]
    assert [(lag, c) for lag, c, _ in trained if lag == 0] == [(0, first), (0, first)], trained
    assert len([t for t in trained if t[0] == 2]) == 2 * len(sweep.corrections), trained
    for correction in sweep.corrections:
        assert result["sweep"][correction][0] == result["sweep"][first][0], correction
    figures = off_policy.summarize(result)
    assert figures["lag0_auc_spread"] is None
    assert len(figures["sweep"]) == 2 * len(sweep.corrections)
    assert off_policy.SWEEP.share_lag0 and not off_policy.SMOKE_SWEEP.share_lag0
