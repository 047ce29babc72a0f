"""The known wrong versions of Part 1's exercises (PPO): the losses, in notebook order (value_loss, clipped_surrogate,
ppo_loss).
Gathered into the part's registry by mistakes.py."""


import torch

from solutions import part1_ppo as ref
from tests.support import Exercise, mistake
from utils.masks import masked_mean


# --- value_loss --------------------------------------------------------------------------------------------

def _value_errors(values, returns, old_values, clip, *, distance=torch.square, detach_returns=True,
                  detach_old=True, combine=torch.maximum, clipped_at=None):
    """Each token's error as the reference computes it (clipped when clip is not None), with the mistakes the keywords
    name: a mutant keeps its mistake when the loss is clipped too."""
    target = returns.detach() if detach_returns else returns
    errors = distance(values - target)
    if clip is None:
        return errors
    old = old_values.detach() if detach_old else old_values
    clipped = clipped_at(values, old, clip) if clipped_at else old + (values - old).clamp(-clip, clip)
    return combine(errors, distance(clipped - target))


def _value_loss_no_half(values, returns, completion_mask, old_values=None, clip=None):
    """Forgets the 0.5 in front of the mean squared error."""
    return masked_mean(_value_errors(values, returns, old_values, clip), completion_mask)


def _value_loss_unmasked(values, returns, completion_mask, old_values=None, clip=None):
    """Averages over every position, padding after the first EOS included. Average over the valid tokens:
    masked_mean(..., completion_mask)."""
    return 0.5 * _value_errors(values, returns, old_values, clip).mean()


def _value_loss_masked_sum_over_all(values, returns, completion_mask, old_values=None, clip=None):
    """Zeroes the padding but divides by the number of all positions (.mean() after masking). Divide by the number
    of valid tokens: masked_mean."""
    return 0.5 * (_value_errors(values, returns, old_values, clip) * completion_mask).mean()


def _value_loss_sum(values, returns, completion_mask, old_values=None, clip=None):
    """Sums over the valid tokens instead of averaging."""
    return 0.5 * (_value_errors(values, returns, old_values, clip) * completion_mask).sum()


def _value_loss_mean_of_rows(values, returns, completion_mask, old_values=None, clip=None):
    """Averages each completion over its tokens, then averages the completions: short completions then weigh as
    much as long ones. Average over all valid tokens at once: masked_mean(..., completion_mask)."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip), completion_mask, dim=1).mean()


def _value_loss_l1(values, returns, completion_mask, old_values=None, clip=None):
    """Uses the absolute error; the value loss is 0.5 * the mean *squared* error."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, distance=torch.abs), completion_mask)


@mistake("gradient")
def _value_loss_returns_not_detached(values, returns, completion_mask, old_values=None, clip=None):
    """Lets the gradient flow into the returns. They are fixed targets: detach them."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, detach_returns=False), completion_mask)


@mistake("gradient")
def _value_loss_values_detached(values, returns, completion_mask, old_values=None, clip=None):
    """Detaches the values, so the loss cannot train the value head. Only the returns are constants."""
    return 0.5 * masked_mean(_value_errors(values.detach(), returns, old_values, clip), completion_mask)


@mistake("inputs")
def _value_loss_in_place(values, returns, completion_mask, old_values=None, clip=None):
    """Subtracts the returns from the caller's values in place (values -= returns). Compute a new tensor."""
    with torch.no_grad():
        values -= returns
    return 0.5 * masked_mean(_value_errors(values + returns, returns, old_values, clip), completion_mask)


@mistake("argument")
def _value_loss_ignores_clip(values, returns, completion_mask, old_values=None, clip=None):
    """Never clips, whatever clip says. With clip, each token's error is the larger of (values - returns)^2 and
    (old_values + clamp(values - old_values, -clip, clip) - returns)^2."""
    return 0.5 * masked_mean((values - returns.detach()) ** 2, completion_mask)


def _value_loss_min_of_errors(values, returns, completion_mask, old_values=None, clip=None):
    """Takes the smaller of the clipped and the unclipped errors. Take the larger (torch.maximum), as the surrogate
    takes the smaller of two objectives: the pessimistic choice, so that moving a value past the clip earns nothing."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, combine=torch.minimum), completion_mask)


def _value_loss_clipped_error_only(values, returns, completion_mask, old_values=None, clip=None):
    """With clip, uses only the clipped error (v_clipped - returns)^2. Take the larger of it and the unclipped error
    (values - returns)^2: a value that moved *away* from the return must still be pulled back."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, combine=lambda e, c: c),
                             completion_mask)


def _value_loss_clamps_the_values(values, returns, completion_mask, old_values=None, clip=None):
    """Clamps the values themselves to [-clip, clip]. The clip bounds how far each value moves from its old value:
    v_clipped = old_values + clamp(values - old_values, -clip, clip)."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip,
                                           clipped_at=lambda v, old, c: v.clamp(-c, c)), completion_mask)


@mistake("gradient")
def _value_loss_old_values_not_detached(values, returns, completion_mask, old_values=None, clip=None):
    """Lets the gradient flow into the old values. They were stored at rollout time, constants like the returns:
    detach them."""
    return 0.5 * masked_mean(_value_errors(values, returns, old_values, clip, detach_old=False), completion_mask)


# --- clipped_surrogate -------------------------------------------------------------------------------------

def _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, *, combine=torch.minimum,
               ratio_fn=None, clip=True, reduce=None, clip_adv=False, detach=True):
    adv = advantages.detach() if detach else advantages
    old = old_logprobs.detach() if detach else old_logprobs
    ratio = ratio_fn(logprobs, old) if ratio_fn else (logprobs - old).exp()
    if clip_adv:
        clipped = ratio * adv.clamp(1 - clip_eps, 1 + clip_eps)
    else:
        clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv if clip else ratio * adv
    per_token = combine(ratio * adv, clipped)
    return reduce(per_token) if reduce else masked_mean(per_token, completion_mask)


def _surrogate_max(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Takes the max of the clipped and unclipped terms. The objective is pessimistic: their min."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, combine=torch.maximum)


def _surrogate_log_ratio(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Uses logprobs - old_logprobs as the ratio. The ratio is p_new / p_old = exp(logprobs - old_logprobs)."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, ratio_fn=lambda a, b: a - b)


def _surrogate_inverted_ratio(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Uses p_old / p_new. The ratio is p_new / p_old = exp(logprobs - old_logprobs)."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps,
                      ratio_fn=lambda a, b: (b - a).exp())


def _surrogate_no_clip(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Leaves out the clipping: min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, clip=False)


def _surrogate_clips_advantages(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Clips the advantages instead of the ratio: clip(ratio, 1 - eps, 1 + eps) * A."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, clip_adv=True)


def _surrogate_unmasked(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Averages over every position, padding after the first EOS included: average over the valid tokens."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, reduce=lambda x: x.mean())


def _surrogate_negated(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Returns the negated objective (a loss). clipped_surrogate is the objective to *maximise*; ppo_loss negates it."""
    return -ref.clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps)


def _surrogate_min_of_ratios(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Takes min(ratio, clip(ratio)) and then multiplies by A: for a negative advantage the min must be taken after
    multiplying, min(ratio * A, clip(ratio) * A)."""
    adv = advantages.detach()
    ratio = (logprobs - old_logprobs.detach()).exp()
    return masked_mean(torch.minimum(ratio, ratio.clamp(1 - clip_eps, 1 + clip_eps)) * adv, completion_mask)


@mistake("argument")
def _surrogate_fixed_clip(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Clips to [0.8, 1.2] whatever clip_eps says. Clip to [1 - clip_eps, 1 + clip_eps]."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, 0.2)


@mistake("gradient")
def _surrogate_not_detached(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Lets gradients flow into the advantages and the old log-probs. They are constants of the policy update:
    detach them."""
    return _surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps, detach=False)


@mistake("gradient")
def _surrogate_clip_detached(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Detaches the ratio in the clipped term, so tokens inside the clip range lose part of their gradient. Clip the
    ratio itself: ratio.clamp(1 - eps, 1 + eps) keeps the graph where it does not clip."""
    adv = advantages.detach()
    ratio = (logprobs - old_logprobs.detach()).exp()
    return masked_mean(torch.minimum(ratio * adv, ratio.detach().clamp(1 - clip_eps, 1 + clip_eps) * adv),
                       completion_mask)


@mistake("inputs")
def _surrogate_masks_advantages_in_place(logprobs, old_logprobs, advantages, completion_mask, clip_eps=0.2):
    """Zeroes the caller's advantages after the first EOS in place (advantages[~mask] = 0). Leave the inputs alone:
    masked_mean already ignores those positions."""
    with torch.no_grad():
        advantages[~completion_mask] = 0.0
    return ref.clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, clip_eps)


# --- ppo_loss ----------------------------------------------------------------------------------------------

def _ppo_loss_with(name, doc, kind="values", entropy_sign=-1.0, objective_sign=-1.0, fixed=None, detach=False,
                   kl_fn=None, mean_all=False, weighted_terms=False, normalise_in_place=False, tensor_terms=False,
                   value_clip="clip_value"):
    """A ppo_loss with one mistake, named `name` and described by `doc`. value_clip: what clips the value loss
    ("clip_value", "clip_eps", or None for nothing)."""

    def loss_fn(logits, values, logprobs, old_logprobs, advantages, returns, ref_logits, completion_mask,
                clip_eps=0.2, vf_coef=0.5, ent_coef=0.001, kl_coef=0.2, old_values=None, clip_value=None):
        coefs = dict(clip_eps=clip_eps, vf_coef=vf_coef, ent_coef=ent_coef, kl_coef=kl_coef) | (fixed or {})
        clip = {"clip_value": clip_value, "clip_eps": clip_eps if clip_value is not None else None}.get(value_clip)
        if normalise_in_place:
            with torch.no_grad():
                advantages -= masked_mean(advantages, completion_mask)
        objective = ref.clipped_surrogate(logprobs, old_logprobs, advantages, completion_mask, coefs["clip_eps"])
        v_loss = ref.value_loss(values, returns, completion_mask, old_values, clip)
        reduce = (lambda x: x.mean()) if mean_all else (lambda x: masked_mean(x, completion_mask))
        ent = reduce(ref.entropy(logits, completion_mask))
        kl = reduce((kl_fn or ref.kl_exact)(logits, ref_logits, completion_mask))
        loss = (objective_sign * objective + coefs["vf_coef"] * v_loss + entropy_sign * coefs["ent_coef"] * ent
                + coefs["kl_coef"] * kl)
        terms = {"objective": objective.item(), "value_loss": v_loss.item(), "entropy": ent.item(), "kl": kl.item()}
        if tensor_terms:
            terms = {"objective": objective, "value_loss": v_loss, "entropy": ent, "kl": kl}
        if weighted_terms:
            terms = {"objective": objective.item(), "value_loss": coefs["vf_coef"] * v_loss.item(),
                     "entropy": coefs["ent_coef"] * ent.item(), "kl": coefs["kl_coef"] * kl.item()}
        return (torch.tensor(loss.item()) if detach else loss), terms

    loss_fn.__name__, loss_fn.__qualname__, loss_fn.__doc__ = name, name, doc
    return mistake(kind)(loss_fn)


_ppo_loss_entropy_sign = _ppo_loss_with(
    "_ppo_loss_entropy_sign", "Adds the entropy bonus to the loss. A bonus is subtracted from the loss we minimise: "
    "- ent_coef * entropy.", entropy_sign=1.0)
_ppo_loss_objective_not_negated = _ppo_loss_with(
    "_ppo_loss_objective_not_negated", "Adds the clipped surrogate to the loss. It is an objective to maximise, so "
    "the loss has its negative: -objective.", objective_sign=1.0)
_ppo_loss_no_vf_coef = _ppo_loss_with(
    "_ppo_loss_no_vf_coef", "Leaves out vf_coef: the value loss is weighted by vf_coef.", kind="argument",
    fixed={"vf_coef": 1.0})
_ppo_loss_no_kl = _ppo_loss_with(
    "_ppo_loss_no_kl", "Leaves out the KL penalty (or ignores kl_coef): add kl_coef * KL(policy || reference).",
    kind="argument", fixed={"kl_coef": 0.0})
_ppo_loss_no_entropy = _ppo_loss_with(
    "_ppo_loss_no_entropy", "Leaves out the entropy bonus (or ignores ent_coef): subtract ent_coef * entropy.",
    kind="argument", fixed={"ent_coef": 0.0})
_ppo_loss_fixed_clip = _ppo_loss_with(
    "_ppo_loss_fixed_clip", "Clips with 0.2 whatever clip_eps says: pass clip_eps on to clipped_surrogate.",
    kind="argument", fixed={"clip_eps": 0.2})
_ppo_loss_detached = _ppo_loss_with(
    "_ppo_loss_detached", "Rebuilds the loss from a Python number (.item() then torch.tensor), so nothing can be "
    "backpropagated. Return the loss tensor itself; only the logged terms are floats.", kind="gradient", detach=True)
_ppo_loss_kl_reversed = _ppo_loss_with(
    "_ppo_loss_kl_reversed", "Penalises KL(reference || policy). The penalty is KL(policy || reference): "
    "kl_exact(logits, ref_logits, mask).", kl_fn=lambda lg, rlg, m: ref.kl_exact(rlg, lg, m))
_ppo_loss_mean_over_all = _ppo_loss_with(
    "_ppo_loss_mean_over_all", "Averages the entropy and the KL over every position, padding included. Average "
    "them over the valid tokens: masked_mean(..., completion_mask).", mean_all=True)
_ppo_loss_weighted_terms = _ppo_loss_with(
    "_ppo_loss_weighted_terms", "Logs the terms multiplied by their coefficients. The terms are the unweighted "
    "objective, value loss, entropy and KL.", weighted_terms=True)
_ppo_loss_tensor_terms = _ppo_loss_with(
    "_ppo_loss_tensor_terms", "Returns the terms as tensors. They are for logging: Python floats (.item()), which "
    "hold no computation graph.", tensor_terms=True)
_ppo_loss_normalises_in_place = _ppo_loss_with(
    "_ppo_loss_normalises_in_place", "Centres the caller's advantages in place (advantages -= mean). Leave the "
    "inputs alone: the trainer normalises the advantages before calling ppo_loss.", kind="inputs",
    normalise_in_place=True)
_ppo_loss_value_not_clipped = _ppo_loss_with(
    "_ppo_loss_value_not_clipped", "Never clips the value loss, whatever clip_value says: pass old_values and "
    "clip_value on to value_loss.", kind="argument", value_clip=None)
_ppo_loss_value_clipped_with_clip_eps = _ppo_loss_with(
    "_ppo_loss_value_clipped_with_clip_eps", "Clips the value loss with clip_eps, the ratio's clip range. CleanRL "
    "uses one coefficient for both, but here the value clip is its own setting: value_loss(..., old_values, "
    "clip_value).", value_clip="clip_eps")


EXERCISES = {
    "value_loss": Exercise(
        wrong=[_value_loss_no_half, _value_loss_unmasked, _value_loss_masked_sum_over_all, _value_loss_sum,
               _value_loss_mean_of_rows, _value_loss_l1, _value_loss_returns_not_detached, _value_loss_values_detached,
               _value_loss_in_place, _value_loss_ignores_clip, _value_loss_min_of_errors,
               _value_loss_clipped_error_only, _value_loss_clamps_the_values, _value_loss_old_values_not_detached],
    ),
    "clipped_surrogate": Exercise(
        wrong=[_surrogate_max, _surrogate_log_ratio, _surrogate_inverted_ratio, _surrogate_no_clip,
               _surrogate_clips_advantages, _surrogate_unmasked, _surrogate_negated, _surrogate_min_of_ratios,
               _surrogate_fixed_clip, _surrogate_not_detached, _surrogate_clip_detached,
               _surrogate_masks_advantages_in_place],
    ),
    "ppo_loss": Exercise(
        wrong=[_ppo_loss_entropy_sign, _ppo_loss_objective_not_negated, _ppo_loss_no_vf_coef, _ppo_loss_no_kl,
               _ppo_loss_no_entropy, _ppo_loss_fixed_clip, _ppo_loss_detached, _ppo_loss_kl_reversed,
               _ppo_loss_mean_over_all, _ppo_loss_weighted_terms, _ppo_loss_tensor_terms, _ppo_loss_normalises_in_place,
               _ppo_loss_value_not_clipped, _ppo_loss_value_clipped_with_clip_eps],
    ),
}
