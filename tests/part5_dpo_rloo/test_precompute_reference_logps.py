"""precompute_reference_logps: the reference's (the base without hooks) sequence log-probs of every pair, chosen
then rejected, scored batch_size pairs at a time, leaving the model, its hooks and the pairs alone."""

import pytest
import torch
from torch import Tensor

from solutions import part5_dpo_rloo as ref
from tests.part5_dpo_rloo.common import LORA_TARGETS, MIXED_TRIPLES
from tests.support import (aside, assert_close, assert_hooks_clean, assert_inputs_unchanged, exercise, expect,
                           lora_model_with_random_B)

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model

PRECOMPUTE_HINT = ("The reference is lora_model.base (no hooks), run without gradients on preference_batch(...) of "
                   "each batch_size pairs; its rows are [chosen; rejected], scored by completion_logprobs and "
                   "summed (or averaged) by sequence_logps.")


def assert_close_or_reordered(got, expected, what, hint):
    """assert_close, after saying so first when `got` holds exactly the expected numbers in other places."""
    if isinstance(got, Tensor) and got.shape == expected.shape and not torch.allclose(got, expected, atol=1e-4):
        same_numbers = torch.allclose(got.sort().values, expected.sort().values, atol=1e-4)
        moved = (~torch.isclose(got, expected, atol=1e-4)).nonzero().flatten().tolist()
        expect(not same_numbers, what, f"the right numbers, in the wrong places (positions {moved} hold values that "
               "belong elsewhere): chosen must be the first n rows of each preference_batch and rejected the last n "
               "(logps.chunk(2)), batch after batch in the order of the triples", observed=got)
    assert_close(got, expected, what, atol=1e-4, hint=hint)


def expect_pair_of_tensors(out, n, what):
    if isinstance(out, (tuple, list)):
        shapes = tuple(tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in out)
        got = f"{type(out).__name__} {shapes}"
    else:
        shapes = got = f"a {type(out).__name__}"
    expect(isinstance(out, tuple) and shapes == ((n,), (n,)), what, f"expected a tuple (chosen, rejected) of two "
           f"tensors of shape ({n},), one number per pair; got {got}", observed=shapes)


@exercise("precompute_reference_logps")
def test_precompute_reference_logps_is_the_base_without_hooks(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1, targets=LORA_TARGETS)
    for average in (False, True):
        what = f"precompute_reference_logps(lora_model, triples, average={average}, batch_size=2)"
        out = impl.precompute_reference_logps(lora_model, MIXED_TRIPLES, average, batch_size=2)
        expect_pair_of_tensors(out, len(MIXED_TRIPLES), what)
        expected = ref.precompute_reference_logps(lora_model, MIXED_TRIPLES, average, batch_size=2)
        assert_close_or_reordered(torch.cat(out), torch.cat(expected), f"chosen then rejected log-probs (the two "
                                  f"tensors concatenated) from {what}", hint=PRECOMPUTE_HINT)


@exercise("precompute_reference_logps")
def test_precompute_reference_logps_in_batches_of_batch_size(impl, tiny_model):
    """Each forward pass scores at most 2 × batch_size rows, every row once; the result does not depend on
    batch_size."""
    lora_model = lora_model_with_random_B(tiny_model, seed=2, targets=LORA_TARGETS)
    expected = ref.precompute_reference_logps(lora_model, MIXED_TRIPLES, True, batch_size=256)
    for batch_size in (2, 3):
        rows: list[int] = []
        tiny_model.add_hook("hook_embed", lambda x, hook: rows.append(x.shape[0]))
        try:
            out = impl.precompute_reference_logps(lora_model, MIXED_TRIPLES, True, batch_size=batch_size)
        finally:
            tiny_model.reset_hooks()
        what = f"precompute_reference_logps(..., average=True, batch_size={batch_size}) on 5 pairs"
        twice = sum(rows) == 4 * len(MIXED_TRIPLES)
        expect(rows and max(rows) <= 2 * batch_size and sum(rows) == 2 * len(MIXED_TRIPLES),
               f"the forward passes of {what}", f"expected forward passes of at most {2 * batch_size} rows "
               f"(batch_size pairs, chosen and rejected) that score the {2 * len(MIXED_TRIPLES)} rows once each; got "
               f"passes of {rows} rows" + (f", {sum(rows)} in all: twice as many" if twice else "")
               + ". Loop over the pairs in steps of batch_size, one preference_batch each, and run only the reference"
               + (aside("Common cause: the LoRA model run as well as the reference.") if twice else ""),
               observed=rows)
        expect_pair_of_tensors(out, len(MIXED_TRIPLES), what)
        assert_close_or_reordered(torch.cat(out), torch.cat(expected), f"chosen then rejected log-probs (the two "
                                  f"tensors concatenated) from {what}", hint=PRECOMPUTE_HINT)


@exercise("precompute_reference_logps")
def test_precompute_reference_logps_leaves_model_hooks_and_pairs_alone(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=3, targets=LORA_TARGETS)
    triples = list(MIXED_TRIPLES)
    assert_inputs_unchanged(impl.precompute_reference_logps, lora_model, triples, False, 2,
                            what="precompute_reference_logps")
    assert_hooks_clean(lora_model, lambda: impl.precompute_reference_logps(lora_model, triples, False, 2),
                       what="precompute_reference_logps")
