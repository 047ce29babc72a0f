"""The known wrong versions of the off_policy experiment's exercises: clip_fraction, truncated_importance_weights,
tis_grpo_loss, expected_grpo_objective. Each docstring is what a learner whose version fails the same way reads."""

import torch

from solutions import part6_lab as ref
from tests.support import Exercise, mistake


# --- clip_fraction -----------------------------------------------------------------------------------------------

@mistake("zero")
def _cf_epsilon_high_or_epsilon(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """`epsilon_high or epsilon` took epsilon_high = 0 (no room above 1: a ratio above 1 with a positive advantage is
    clipped) for "not given", and used epsilon instead. 0 is a value: epsilon if epsilon_high is None else
    epsilon_high."""
    return ref.clip_fraction(ratio, advantages, mask, epsilon, epsilon_high or epsilon)


def _cf_any_sign(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted every token whose ratio is outside the clip range, whatever its advantage's sign. The clip takes the
    gradient only where it binds: below 1 - epsilon when A < 0, above 1 + epsilon_high when A > 0 (TRL's
    clip_ratio/region_mean); elsewhere min(ratio·A, clip(ratio)·A) picks the unclipped term."""
    high = epsilon if epsilon_high is None else epsilon_high
    clipped = (ratio < 1 - epsilon) | (ratio > 1 + high)
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_signs_swapped(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Paired the sides with the wrong signs (below 1 - epsilon with A > 0, above 1 + epsilon_high with A < 0): that
    is where the unclipped term is the smaller one and the gradient flows. Count ratio < 1 - epsilon with A < 0 and
    ratio > 1 + epsilon_high with A > 0."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign > 0)) | ((ratio > 1 + high) & (sign < 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_zero_advantage_counts(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted tokens whose advantage is 0 (A <= 0, A >= 0): such a token has no gradient to take away, and TRL
    compares strictly (A < 0, A > 0). Groups whose rewards are all equal have A = 0 on every token."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign <= 0)) | ((ratio > 1 + high) & (sign >= 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_inclusive_bounds(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted a ratio exactly on a bound (<= 1 - epsilon, >= 1 + epsilon_high) as clipped: on the bound the clipped
    and unclipped terms are equal and the gradient still flows. Compare strictly, as TRL does."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio <= 1 - epsilon) & (sign < 0)) | ((ratio >= 1 + high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


def _cf_unmasked(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted clipped padding positions too (their ratio means nothing): count only where mask is True."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return clipped.sum() / mask.sum().clamp(min=1)


def _cf_over_all_positions(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Divided by every position (.mean() over the padded tensor) rather than by the number of real tokens:
    divide by mask.sum()."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return (clipped & mask).float().mean()


def _cf_count(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Returned the number of clipped tokens, not their share: divide by the number of real tokens."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return (clipped & mask).sum().float()


def _cf_low_only(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Counted only the low side (ratio < 1 - epsilon with A < 0): TRL's region fraction also counts ratio >
    1 + epsilon_high with A > 0."""
    clipped = (ratio < 1 - epsilon) & (advantages[:, None] < 0)
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@mistake("argument")
def _cf_ignores_epsilon_high(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Used epsilon on both sides and ignored epsilon_high: the upper bound is 1 + epsilon_high when it is given
    (DAPO's clip-higher)."""
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + epsilon) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@mistake("argument")
def _cf_ignores_epsilon(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Used the default 0.2 whatever epsilon was passed: the bounds are 1 - epsilon and 1 + epsilon_high (epsilon_high
    None: epsilon)."""
    return ref.clip_fraction(ratio, advantages, mask, 0.2, epsilon_high)


def _cf_per_sequence(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Averaged each sequence's clipped share, then the sequences: TRL counts tokens, sum of clipped real tokens
    over the number of real tokens in the batch."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return ((clipped & mask).sum(1) / mask.sum(1).clamp(min=1)).mean()


def _cf_nan_without_tokens(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Divided by mask.sum() unclamped: no real token gives 0/0 = NaN. Clamp the count to at least 1."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign = advantages[:, None]
    clipped = ((ratio < 1 - epsilon) & (sign < 0)) | ((ratio > 1 + high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum()


def _cf_log_ratio(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Compared the log of the ratio with -epsilon and +epsilon_high: the clip range is on the ratio itself,
    [1 - epsilon, 1 + epsilon_high]."""
    high = epsilon if epsilon_high is None else epsilon_high
    sign, log_ratio = advantages[:, None], ratio.log()
    clipped = ((log_ratio < -epsilon) & (sign < 0)) | ((log_ratio > high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


@mistake("inputs")
def _cf_in_place(ratio, advantages, mask, epsilon=0.2, epsilon_high=None):
    """Subtracted 1 from the caller's ratios in place (ratio -= 1, ratio.sub_(1)): the caller still needs them;
    compare without writing into the input."""
    high = epsilon if epsilon_high is None else epsilon_high
    ratio -= 1
    sign = advantages[:, None]
    clipped = ((ratio < -epsilon) & (sign < 0)) | ((ratio > high) & (sign > 0))
    return (clipped & mask).sum() / mask.sum().clamp(min=1)


# --- truncated_importance_weights --------------------------------------------------------------------------------

@mistake("gradient")
def _tisw_not_detached(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Kept the trainer's log-probs attached to the graph, so the weight sends a gradient of its own into the
    policy: detach them (the weight is a constant factor in Yao et al.'s estimator)."""
    ratio = torch.exp(trainer_logprobs - sampler_logprobs)
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


def _tisw_two_sided(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Clipped the ratio from both sides, to [1/cap, cap]: truncated importance sampling caps it from above only
    (min(ratio, cap)); a token the sampler liked more than the trainer keeps its small weight."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return torch.where(mask, ratio.clamp(1 / cap, cap), 0.0)


def _tisw_inverted(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Inverted the ratio (pi_sampler / pi_trainer): the samples come from the sampler, so the importance weight
    that turns them into the trainer's expectation is pi_trainer / pi_sampler = exp(trainer - sampler)."""
    ratio = torch.exp(sampler_logprobs.detach() - trainer_logprobs.detach())
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


def _tisw_unmasked(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Left weights on padding (mask False): set them to 0 there."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return ratio.clamp(max=cap)


@mistake("argument")
def _tisw_default_cap(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Capped at 2 whatever cap was passed: use the `cap` argument."""
    return ref.truncated_importance_weights(trainer_logprobs, sampler_logprobs, mask, 2.0)


def _tisw_no_cap(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Did not cap the ratio: plain importance sampling, whose weights can be huge where the sampler gave a token
    little probability. Take min(ratio, cap)."""
    ratio = torch.exp(trainer_logprobs.detach() - sampler_logprobs.detach())
    return torch.where(mask, ratio, 0.0)


def _tisw_capped_log_ratio(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Capped the log-ratio at cap, so the weight goes up to e^cap: cap the ratio itself, min(exp(trainer -
    sampler), cap)."""
    log_ratio = (trainer_logprobs.detach() - sampler_logprobs.detach()).clamp(max=cap)
    return torch.where(mask, log_ratio.exp(), 0.0)


def _tisw_ratio_of_logprobs(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Divided the log-probs (trainer / sampler) instead of the probabilities: the ratio of probabilities is the exp
    of the difference of log-probs, exp(trainer - sampler)."""
    ratio = trainer_logprobs.detach() / sampler_logprobs.detach()
    return torch.where(mask, ratio.clamp(max=cap), 0.0)


def _tisw_sequence_level(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Weighted every token of a sequence by the whole sequence's ratio (the product over its tokens), capped: Yao et
    al.'s token-level weights use each token's own ratio, which stays near 1 where a sequence's product explodes."""
    log_ratio = ((trainer_logprobs.detach() - sampler_logprobs.detach()) * mask).sum(1, keepdim=True)
    return torch.where(mask, log_ratio.exp().clamp(max=cap), 0.0)


@mistake("inputs")
def _tisw_in_place(trainer_logprobs, sampler_logprobs, mask, cap=2.0):
    """Wrote the log-ratio into the caller's trainer log-probs (trainer_logprobs -= sampler_logprobs): the trainer
    still needs them; compute the difference as a new tensor."""
    trainer_logprobs.sub_(sampler_logprobs)
    return torch.where(mask, trainer_logprobs.detach().exp().clamp(max=cap), 0.0)


# --- tis_grpo_loss -----------------------------------------------------------------------------------------------

def _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, *, weight_inside=False,
               ratio_detached=False, take_max=False, reduce="dapo", detach_weights=True):
    old = (logprobs if ratio_detached else logprobs.detach()) if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    high = epsilon if epsilon_high is None else epsilon_high
    w = None if weights is None else (weights.detach() if detach_weights else weights)
    if weight_inside and w is not None:
        ratio = ratio * w
    A = advantages[:, None]
    pick = torch.max if take_max else torch.min
    per_token = -pick(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if w is not None and not weight_inside:
        per_token = per_token * w
    if reduce == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    if reduce == "weighted":
        return (per_token * mask).sum() / (w * mask).sum().clamp(min=1e-8) if w is not None else \
            (per_token * mask).sum() / mask.sum().clamp(min=1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@mistake("argument")
def _tisl_ignores_weights(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Ignored the weights: multiply each token's clipped term by its weight before summing."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, None, epsilon, epsilon_high)


def _tisl_weight_inside_ratio(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                              epsilon_high=None):
    """Multiplied the weight into the ratio before the clip, so the clip cuts the correction (and a weight far from
    1 looks like a policy that moved): the weight multiplies the whole clipped term, -min(r·A, clip(r)·A) · w."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, weight_inside=True)


@mistake("gradient")
def _tisl_weights_not_detached(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                               epsilon_high=None):
    """Let a gradient flow into the weights: they are constants (detach them), or the trainer's log-probs they were
    made from get a second, wrong gradient."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, detach_weights=False)


def _tisl_weight_after_mean(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Multiplied the averaged loss by the mean weight: each token's own term must be multiplied by its own weight,
    before the sum."""
    loss = _tisl_core(logprobs, old_logprobs, advantages, mask, None, epsilon, epsilon_high)
    if weights is None:
        return loss
    return loss * (weights.detach() * mask).sum() / mask.sum().clamp(min=1)


def _tisl_self_normalized(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Divided by the sum of the weights (self-normalised importance sampling) instead of the number of real tokens:
    truncated importance sampling keeps the 'dapo' denominator, the number of tokens."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, reduce="weighted")


def _tisl_max(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Took the max of the two terms: PPO's objective is the pessimistic min(ratio·A, clip(ratio)·A), so the loss
    is minus the min."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, take_max=True)


@mistake("argument")
def _tisl_ignores_epsilon_high(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                               epsilon_high=None):
    """Clipped at 1 + epsilon above whatever epsilon_high was: the upper bound is 1 + epsilon_high when it is
    given."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, None)


@mistake("gradient")
def _tisl_on_policy_ratio_detached(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                                   epsilon_high=None):
    """With old_logprobs None, took old = logprobs without .detach(): the ratio exp(logprobs - logprobs) is then a
    constant 1 with no gradient, and nothing trains. The old side is logprobs.detach()."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, ratio_detached=True)


def _tisl_per_sequence(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Averaged each sequence's tokens, then the sequences ('grpo'): this loss is 'dapo', the sum over every real
    token of the batch divided by their number."""
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high, reduce="grpo")


def _tisl_objective(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Returned the objective min(ratio·A, clip(ratio)·A), to maximise, instead of the loss to minimise: negate
    it."""
    return -_tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high)


@mistake("inputs")
def _tisl_masks_weights_in_place(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2,
                                 epsilon_high=None):
    """Masked the caller's weights in place (weights *= mask): they are the caller's; multiply into a new tensor."""
    if weights is not None:
        weights.mul_(mask)
    return _tisl_core(logprobs, old_logprobs, advantages, mask, weights, epsilon, epsilon_high)


@mistake("masked")
def _tisl_nan_without_tokens(logprobs, old_logprobs, advantages, mask, weights=None, epsilon=0.2, epsilon_high=None):
    """Divided by mask.sum() as it is: a batch with no real token (every completion dropped as truncated) gives
    0/0 = NaN, and one NaN loss turns every weight into NaN at the next step. The docstring says 0 there: divide by
    mask.sum().clamp(min=1)."""
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    high = epsilon if epsilon_high is None else epsilon_high
    A = advantages[:, None]
    per_token = -torch.min(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if weights is not None:
        per_token = per_token * weights.detach()
    return (per_token * mask).sum() / mask.sum()


# --- expected_grpo_objective -------------------------------------------------------------------------------------

def _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, *, detach_probs=True,
              detach_weights=True, ratio_detached=False, weight_inside=False, take_max=False, token_mean=False,
              over="sum", probs_from=None):
    old = (logprobs if ratio_detached else logprobs.detach()) if old_logprobs is None else old_logprobs
    ratio = torch.exp(logprobs - old)
    high = epsilon if epsilon_high is None else epsilon_high
    w = None if weights is None else (weights.detach() if detach_weights else weights)
    if weight_inside and w is not None:
        ratio = ratio * w
    A = advantages[:, None]
    pick = torch.max if take_max else torch.min
    per_token = pick(ratio * A, ratio.clamp(1 - epsilon, 1 + high) * A)
    if w is not None and not weight_inside:
        per_token = per_token * w
    per_completion = per_token.mean(dim=1) if token_mean else per_token.sum(dim=1)
    p = probs if probs_from is None else probs_from
    p = p.detach() if detach_probs else p
    if over == "mean":
        return (p * per_completion).mean()
    if over == "unweighted":
        return per_completion.mean()
    return (p * per_completion).sum()


@mistake("gradient")
def _ego_probs_not_detached(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """Let the gradient flow into probs: the sampling is not differentiated (the expected gradient is sum_y probs[y]
    · grad L(y), not grad of probs[y] · L(y)). Detach probs: on-policy, with probs = pi(y) attached, the gradient
    gets an extra sum_y L(y) grad pi(y)."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, detach_probs=False)


def _ego_mean_over_completions(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2,
                               epsilon_high=None):
    """Averaged probs[y] · L(y) over the completions (.mean()) instead of summing it: probs already weighs each
    completion, so an expectation is the sum over y of probs[y] · L(y)."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, over="mean")


def _ego_unweighted(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """Ignored probs and averaged over the completions, as a batch of samples would be: here each completion stands
    for its probability, so weigh its sum over tokens by probs[y] and sum over y."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, over="unweighted")


def _ego_policy_probabilities(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2,
                              epsilon_high=None):
    """Weighed each completion by the trainer's own probability exp(sum of logprobs) instead of probs: the
    expectation is over what the sampler drew, with the probabilities it drew them with (probs), and the
    corrections (weights, the ratio to old) are what turn it toward the trainer's."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high,
                     probs_from=logprobs.detach().sum(dim=1).exp())


def _ego_token_mean(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """Averaged a completion's tokens instead of summing them: L(y) sums the per-token terms, as the policy gradient
    sums grad log pi over a completion's tokens."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, token_mean=True)


def _ego_max(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """Took the max of the two terms: PPO's objective is the pessimistic min(ratio·A, clip(ratio)·A)."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, take_max=True)


def _ego_loss(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """Returned the loss, minus the objective: this is the objective itself, whose gradient is the expected policy
    gradient (the direction that raises the reward)."""
    return -_ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high)


def _ego_weight_inside_ratio(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2,
                             epsilon_high=None):
    """Multiplied the weight into the ratio before the clip, so the clip cuts the correction: the weight multiplies
    the whole clipped term, min(r·A, clip(r)·A) · w."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, weight_inside=True)


@mistake("argument")
def _ego_ignores_weights(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """Ignored the weights: multiply each token's clipped term by its weight."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, None, epsilon, epsilon_high)


@mistake("argument")
def _ego_ignores_epsilon_high(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2,
                              epsilon_high=None):
    """Clipped at 1 + epsilon above whatever epsilon_high was: the upper bound is 1 + epsilon_high when it is
    given."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, None)


@mistake("zero")
def _ego_epsilon_high_or_epsilon(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2,
                                 epsilon_high=None):
    """`epsilon_high or epsilon` took epsilon_high = 0 (no room above 1) for "not given": 0 is a value; use epsilon
    only when epsilon_high is None."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high or epsilon)


@mistake("gradient")
def _ego_old_not_detached(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """With old_logprobs None, took old = logprobs without .detach(): the ratio is then a constant 1 with no
    gradient, and the objective pulls on nothing. The old side is logprobs.detach()."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, ratio_detached=True)


@mistake("gradient")
def _ego_weights_not_detached(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2,
                              epsilon_high=None):
    """Let a gradient flow into the weights: they are constants (detach them), or the trainer's log-probs they were
    made from get a second, wrong gradient."""
    return _ego_core(probs, logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high, detach_weights=False)


@mistake("inputs")
def _ego_weights_in_place(probs, logprobs, old_logprobs, advantages, weights=None, epsilon=0.2, epsilon_high=None):
    """Multiplied probs into the caller's weights in place (weights *= probs[:, None]): they are the caller's;
    multiply into a new tensor."""
    if weights is None:
        return _ego_core(probs, logprobs, old_logprobs, advantages, None, epsilon, epsilon_high)
    weights.mul_(probs[:, None])
    return _ego_core(torch.ones_like(probs), logprobs, old_logprobs, advantages, weights, epsilon, epsilon_high)


EXERCISES = {
    "clip_fraction": Exercise(
        wrong=[_cf_any_sign, _cf_signs_swapped, _cf_zero_advantage_counts, _cf_inclusive_bounds, _cf_unmasked,
               _cf_over_all_positions, _cf_count, _cf_low_only, _cf_ignores_epsilon_high, _cf_ignores_epsilon,
               _cf_per_sequence, _cf_nan_without_tokens, _cf_log_ratio, _cf_in_place, _cf_epsilon_high_or_epsilon],
    ),
    "truncated_importance_weights": Exercise(
        wrong=[_tisw_not_detached, _tisw_two_sided, _tisw_inverted, _tisw_unmasked, _tisw_default_cap, _tisw_no_cap,
               _tisw_capped_log_ratio, _tisw_ratio_of_logprobs, _tisw_sequence_level, _tisw_in_place],
    ),
    "tis_grpo_loss": Exercise(
        wrong=[_tisl_ignores_weights, _tisl_weight_inside_ratio, _tisl_weights_not_detached, _tisl_weight_after_mean,
               _tisl_self_normalized, _tisl_max, _tisl_ignores_epsilon_high, _tisl_on_policy_ratio_detached,
               _tisl_per_sequence, _tisl_objective, _tisl_masks_weights_in_place, _tisl_nan_without_tokens],
    ),
    "expected_grpo_objective": Exercise(
        wrong=[_ego_probs_not_detached, _ego_mean_over_completions, _ego_unweighted, _ego_policy_probabilities,
               _ego_token_mean, _ego_max, _ego_loss, _ego_weight_inside_ratio, _ego_ignores_weights,
               _ego_ignores_epsilon_high, _ego_epsilon_high_or_epsilon, _ego_old_not_detached,
               _ego_weights_not_detached, _ego_weights_in_place],
    ),
}
