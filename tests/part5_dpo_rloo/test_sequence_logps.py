"""sequence_logps: a sequence's log-prob is the sum (or mean) of its real tokens' log-probs, each real token counts
once (padding never), an empty row gives 0, and the gradient flows."""

import itertools

import torch
from torch import Tensor

from solutions import part5_dpo_rloo as ref
from tests.part5_dpo_rloo.common import expect_counts_where_mask, expect_shape, fresh, ragged_tokens
from tests.support import aside, assert_close, assert_gradients_match, assert_inputs_unchanged, exercise, expect

SEQUENCE_HINT = ("A sequence's log-prob is the sum of its token log-probs where the mask is True (average=True: that "
                 "sum divided by the number of such tokens, at least 1); padding never counts.")


@exercise("sequence_logps")
def test_sequence_logps_sum_and_mean_of_the_masked_tokens(impl):
    for seed, average in itertools.product((0, 1), (False, True)):
        logprobs, mask = ragged_tokens(seed)
        what = f"sequence_logps(logprobs, mask, average={average})"
        out = impl.sequence_logps(*fresh(logprobs, mask), average)
        expect_shape(out, (6,), what, "one log-prob per sequence, for 6 rows of 7 positions",
                     {(7,): "of a reduction over dim 0, the batch: reduce over the tokens, dim=1",
                      (6, 7): "of the token log-probs themselves: the reduction over the tokens (dim=1) is missing",
                      (): "of a reduction over everything: reduce over the tokens only (dim=1)"})
        assert_close(out, ref.sequence_logps(logprobs, mask, average), what, hint=SEQUENCE_HINT)


@exercise("sequence_logps")
def test_sequence_logps_weight_of_each_token(impl):
    """d sequence_logps(...).sum() / d logprobs is how much each token counts in its sequence's log-prob: 1 on real
    tokens (1/length with average=True) and 0 on padding. Rows all non-empty, so a per-row factor can be named."""
    logprobs, mask = ragged_tokens(2, lengths=(4, 7, 1, 3, 2, 5))
    for average in (False, True):
        what = f"the weight of each token in sequence_logps(average={average}) (its gradient)"
        leaf = logprobs.clone().requires_grad_(True)
        out = impl.sequence_logps(leaf, mask.clone(), average)
        has_grad = isinstance(out, Tensor) and out.requires_grad
        expect(has_grad, what, "no gradient flows from the sequence log-probs back to the token log-probs, and DPO "
               "trains through them: " + (
                   "the result is a tensor that does not require grad" + aside(
                       "Common causes: detached, computed under torch.no_grad(), or rebuilt from numbers with "
                       "torch.tensor / .item().") if isinstance(out, Tensor)
                   else f"the result is a {type(out).__name__}, not a tensor"), observed=has_grad)
        (weights,) = torch.autograd.grad(out.sum(), leaf, allow_unused=True)
        weights = torch.zeros_like(leaf) if weights is None else weights
        expect_counts_where_mask(weights, mask, f"which tokens count in sequence_logps(average={average})")
        expected = mask.float() / (mask.sum(1, keepdim=True).clamp(min=1) if average else 1)
        assert_close(weights, expected, what, mask=mask, hint="Each real token counts 1 in the sum (1/length in the "
                     "mean); padding counts 0.")


@exercise("sequence_logps")
def test_sequence_logps_empty_row_inputs_and_gradient(impl):
    logprobs, mask = ragged_tokens(3)  # row 3 is empty
    for average in (False, True):
        assert_inputs_unchanged(impl.sequence_logps, *fresh(logprobs, mask), average,
                                what=f"sequence_logps(average={average})")
        got = impl.sequence_logps(*fresh(logprobs, mask), average)[3:4]
        assert_close(got, torch.zeros(1), f"sequence_logps(average={average}) of a row with no real token",
                     hint="an empty row has log-prob 0 (the sum of nothing), also averaged" + (
                         ": divide by the count clamped to at least 1"
                         if isinstance(got, torch.Tensor) and got.isnan().any() else ""))
        assert_gradients_match(impl.sequence_logps, ref.sequence_logps, (logprobs, mask, average),
                               what=f"sequence_logps(average={average})", wrt=["logprobs"])
