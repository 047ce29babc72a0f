"""The known wrong versions of Part 1's exercises (PPO): the KL estimators and the entropy, in notebook order (kl_exact,
kl_k1, kl_k3, entropy).
Gathered into the part's registry by mistakes.py."""

import math

import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.support import Exercise, mistake


# --- kl_exact ----------------------------------------------------------------------------------------------

def _kl_exact_reversed(logits, ref_logits, completion_mask):
    """Computes KL(reference || policy), the wrong way round. KL(policy || reference) = sum p (log p - log q) with
    p the policy's probabilities."""
    return ref.kl_exact(ref_logits, logits, completion_mask)


def _kl_exact_unmasked(logits, ref_logits, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return ref.kl_exact(logits, ref_logits, torch.ones_like(completion_mask))


def _kl_exact_raw_logits(logits, ref_logits, completion_mask):
    """Uses the raw logits in place of log-probabilities in log p - log q. Logits are log-probabilities only up to a
    constant per position: take log_softmax(dim=-1) first."""
    p = logits.softmax(-1)
    return (p * (logits - ref_logits)).sum(-1) * completion_mask


def _kl_exact_mean_over_vocab(logits, ref_logits, completion_mask):
    """Averages over the vocabulary instead of summing: the KL is a sum over every token of the vocabulary."""
    lp, rlp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return (lp.exp() * (lp - rlp)).mean(-1) * completion_mask


def _kl_exact_kl_div_args_swapped(logits, ref_logits, completion_mask):
    """Calls F.kl_div(policy_logprobs, ref_logprobs, log_target=True), which computes KL(reference || policy):
    kl_div(input, target) is KL(target || input), so the policy goes second."""
    lp, rlp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return nn.functional.kl_div(lp, rlp, reduction="none", log_target=True).sum(-1) * completion_mask


@mistake("gradient")
def _kl_exact_detached_weights(logits, ref_logits, completion_mask):
    """Detaches the probabilities p that weight log p - log q, so half of the KL's gradient is lost. Every factor
    of p * (log p - log q) depends on the policy: keep them all in the graph."""
    lp, rlp = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    return (lp.exp().detach() * (lp - rlp)).sum(-1) * completion_mask


@mistake("inputs")
def _kl_exact_normalises_in_place(logits, ref_logits, completion_mask):
    """Turns the caller's logits into log-probabilities in place (logits -= logsumexp). Compute new tensors:
    logits.log_softmax(dim=-1)."""
    with torch.no_grad():
        logits -= logits.logsumexp(-1, keepdim=True)
    return ref.kl_exact(logits, ref_logits, completion_mask)


# --- kl_k1 -------------------------------------------------------------------------------------------------

def _kl_k1_reversed(logprobs, ref_logprobs, completion_mask):
    """Computes log q - log p, the wrong way round: k1 = log p - log q, p the policy (logprobs)."""
    return (ref_logprobs - logprobs) * completion_mask


def _kl_k1_unmasked(logprobs, ref_logprobs, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return logprobs - ref_logprobs


def _kl_k1_abs(logprobs, ref_logprobs, completion_mask):
    """Takes the absolute value to make k1 non-negative. k1 = log p - log q is negative on some tokens, and only
    its average estimates the KL: leave the sign."""
    return (logprobs - ref_logprobs).abs() * completion_mask


def _kl_k1_ratio(logprobs, ref_logprobs, completion_mask):
    """Returns the probability ratio p / q, not its log: k1 = log p - log q."""
    return (logprobs - ref_logprobs).exp() * completion_mask


@mistake("gradient")
def _kl_k1_detached(logprobs, ref_logprobs, completion_mask):
    """Detaches the policy's log-probs, so the penalty gives no gradient to the policy. Keep logprobs in the graph."""
    return (logprobs.detach() - ref_logprobs) * completion_mask


@mistake("inputs")
def _kl_k1_masks_in_place(logprobs, ref_logprobs, completion_mask):
    """Zeroes the caller's log-probs after the first EOS in place (masked_fill_). Compute a new tensor:
    (logprobs - ref_logprobs) * completion_mask."""
    with torch.no_grad():
        logprobs.masked_fill_(~completion_mask, 0.0)
        ref_logprobs.masked_fill_(~completion_mask, 0.0)
    return logprobs - ref_logprobs


# --- kl_k3 -------------------------------------------------------------------------------------------------

def _kl_k3_inverted(logprobs, ref_logprobs, completion_mask):
    """Uses r = p / q. In k3 = (r - 1) - log r the ratio is r = q / p = exp(ref_logprobs - logprobs)."""
    log_ratio = logprobs - ref_logprobs
    return (log_ratio.exp() - 1 - log_ratio) * completion_mask


def _kl_k3_no_minus_one(logprobs, ref_logprobs, completion_mask):
    """Leaves out the -1: k3 = (r - 1) - log r."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - log_ratio) * completion_mask


def _kl_k3_plus_log(logprobs, ref_logprobs, completion_mask):
    """Adds log r instead of subtracting it: k3 = (r - 1) - log r."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.exp() - 1 + log_ratio) * completion_mask


def _kl_k3_unmasked(logprobs, ref_logprobs, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return ref.kl_k3(logprobs, ref_logprobs, torch.ones_like(completion_mask))


def _kl_k3_is_k2(logprobs, ref_logprobs, completion_mask):
    """Computes k2 = (log r)^2 / 2, a different (biased) estimator. k3 = (r - 1) - log r with r = q / p."""
    return 0.5 * (ref_logprobs - logprobs) ** 2 * completion_mask


@mistake("gradient")
def _kl_k3_detached_ratio(logprobs, ref_logprobs, completion_mask):
    """Detaches r = exp(log q - log p) in the (r - 1) term, so that term gives no gradient. Keep it in the graph."""
    log_ratio = ref_logprobs - logprobs
    return (log_ratio.detach().exp() - 1 - log_ratio) * completion_mask


@mistake("inputs")
def _kl_k3_in_place(logprobs, ref_logprobs, completion_mask):
    """Builds log r in the caller's tensor (ref_logprobs -= logprobs). Compute a new tensor:
    log_ratio = ref_logprobs - logprobs."""
    with torch.no_grad():
        ref_logprobs -= logprobs
    log_ratio = ref_logprobs
    return (log_ratio.exp() - 1 - log_ratio) * completion_mask


# --- entropy -----------------------------------------------------------------------------------------------

def _entropy_no_minus(logits, completion_mask):
    """Forgets the minus sign: H = -sum p log p, which is never negative."""
    return -ref.entropy(logits, completion_mask)


def _entropy_raw_logits(logits, completion_mask):
    """Uses the raw logits in place of log-probabilities in -sum p log p: take log_softmax(dim=-1) first."""
    return -(logits.softmax(-1) * logits).sum(-1) * completion_mask


def _entropy_unmasked(logits, completion_mask):
    """Leaves positions after the first EOS in: multiply by completion_mask so they are 0."""
    return ref.entropy(logits, torch.ones_like(completion_mask))


def _entropy_mean_over_vocab(logits, completion_mask):
    """Averages over the vocabulary instead of summing: H = -sum over every token of p log p."""
    lp = logits.log_softmax(-1)
    return -(lp.exp() * lp).mean(-1) * completion_mask


def _entropy_bits(logits, completion_mask):
    """Uses log base 2 (bits); the docstring asks for nats, the natural log."""
    lp = logits.log_softmax(-1) / math.log(2)
    return -(logits.softmax(-1) * lp).sum(-1) * completion_mask


def _entropy_softmax_wrong_dim(logits, completion_mask):
    """Takes the softmax over the sequence (dim=1), not the vocabulary (dim=-1)."""
    lp = logits.log_softmax(1)
    return -(lp.exp() * lp).sum(-1) * completion_mask


@mistake("gradient")
def _entropy_detached_probs(logits, completion_mask):
    """Detaches the probabilities p in -sum p log p, so the gradient is wrong: both factors depend on the logits."""
    lp = logits.log_softmax(-1)
    return -(lp.exp().detach() * lp).sum(-1) * completion_mask


@mistake("inputs")
def _entropy_in_place(logits, completion_mask):
    """Turns the caller's logits into log-probabilities in place (logits -= logsumexp). Compute a new tensor:
    logits.log_softmax(dim=-1)."""
    with torch.no_grad():
        logits -= logits.logsumexp(-1, keepdim=True)
    return ref.entropy(logits, completion_mask)


EXERCISES = {
    "kl_exact": Exercise(
        wrong=[_kl_exact_reversed, _kl_exact_unmasked, _kl_exact_raw_logits, _kl_exact_mean_over_vocab,
               _kl_exact_kl_div_args_swapped, _kl_exact_detached_weights, _kl_exact_normalises_in_place],
    ),
    "kl_k1": Exercise(
        wrong=[_kl_k1_reversed, _kl_k1_unmasked, _kl_k1_abs, _kl_k1_ratio, _kl_k1_detached, _kl_k1_masks_in_place],
    ),
    "kl_k3": Exercise(
        wrong=[_kl_k3_inverted, _kl_k3_no_minus_one, _kl_k3_plus_log, _kl_k3_unmasked, _kl_k3_is_k2,
               _kl_k3_detached_ratio, _kl_k3_in_place],
    ),
    "entropy": Exercise(
        wrong=[_entropy_no_minus, _entropy_raw_logits, _entropy_unmasked, _entropy_mean_over_vocab, _entropy_bits,
               _entropy_softmax_wrong_dim, _entropy_detached_probs, _entropy_in_place],
    ),
}
