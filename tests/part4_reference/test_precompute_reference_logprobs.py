"""precompute_reference_logprobs: the table of each kind of reference's log-probs, one tensor per batch in the
dataset's order, with no hooks left and the kinds that are not a reference refused."""

import pytest
import torch
from torch import Tensor

from solutions.part0_warmup import completion_logprobs
from solutions.part2_lora import LoRAModel
from tests.part4_reference.common import fixed_dataset, flags_unchanged, padded_rows, trained_adapters
from tests.support import (aside, assert_close, assert_equal, assert_hooks_clean, assert_inputs_unchanged,
                           assert_raises, each_refusal, exercise, expect)
from utils.sampling import Samples

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def check_table(table, expected: list[Tensor], dataset: list[Samples], what: str):
    expect(isinstance(table, list), f"{what}: the table", f"expected a list with one tensor per batch of the "
           f"dataset, got {type(table).__name__}", observed=type(table).__name__)
    assert_equal(len(table), len(dataset), f"{what}: the number of tensors in the table",
                 hint="one tensor of log-probs per batch of the dataset, in the dataset's order")
    shapes = [tuple(e.shape) for e in expected]
    for i, (got, want, batch) in enumerate(zip(table, expected, dataset)):
        if isinstance(got, Tensor) and tuple(got.shape) != shapes[i] and tuple(got.shape) in shapes:
            j = shapes.index(tuple(got.shape))
            same = torch.allclose(got.detach().double(), expected[j].double(), atol=1e-4, rtol=1e-4)
            expect(False, f"{what}: table[{i}]", f"it {'holds' if same else 'has the shape of'} batch {j}'s "
                   f"log-probs {shapes[j]}, not batch {i}'s {shapes[i]}: table[i] must be dataset[i]'s (training "
                   "looks batch i up as table[i])" + aside(
                       "Common causes: the batches reordered (sorted, reversed, popped from the end), or one batch's "
                       "result used for another."), observed=(i, j, same))
        finding, why = padded_rows(got, want, batch)
        assert_close(got, want, f"{what}: table[{i}]", mask=batch.completion_mask, atol=1e-4, finding=finding,
                     hint=why)


@exercise("precompute_reference_logprobs")
@pytest.mark.parametrize("kind", ["hooks_removed", "old_adapter", "frozen_copy"])
def test_precompute_reference_logprobs_of_each_kind(impl, tiny_model, kind):
    """The table holds the log-probs of the reference of `kind`, before any update: the bare base for
    "hooks_removed", base + the adapter as it is now for "old_adapter", the plain model for "frozen_copy"."""
    lora_model = LoRAModel(tiny_model, trained_adapters(tiny_model, seed=4))  # an adapter that was trained
    dataset = fixed_dataset(lora_model)
    model = tiny_model if kind == "frozen_copy" else lora_model  # full fine-tuning: a plain model, no .base
    with torch.no_grad():
        expected = [completion_logprobs(lora_model if kind == "old_adapter" else tiny_model, b) for b in dataset]
    what = f"precompute_reference_logprobs(model, {kind!r}, dataset)"
    table = flags_unchanged({"model": model}, lambda: assert_inputs_unchanged(
        impl.precompute_reference_logprobs, model, kind, dataset, what=what), what)
    check_table(table, expected, dataset, what)


@exercise("precompute_reference_logprobs")
def test_precompute_reference_logprobs_leaves_no_hooks(impl, tiny_model):
    lora_model = LoRAModel(tiny_model, trained_adapters(tiny_model, seed=5))
    dataset = fixed_dataset(lora_model)
    for kind in ("old_adapter", "hooks_removed"):
        assert_hooks_clean(lora_model, lambda: impl.precompute_reference_logprobs(lora_model, kind, dataset),
                           f"precompute_reference_logprobs(model, {kind!r}, dataset)")


@exercise("precompute_reference_logprobs")
def test_precompute_reference_logprobs_refuses_what_is_not_a_reference(impl, tiny_model):
    lora_model = LoRAModel(tiny_model, trained_adapters(tiny_model, seed=6))
    dataset = fixed_dataset(lora_model)[:1]
    with each_refusal():
        for kind, why in [("none", "kind 'none' (beta == 0) has no reference, so nothing to precompute"),
                          ("lora", "'lora' is not a kind: the kinds are 'hooks_removed', 'old_adapter', "
                                   "'frozen_copy'")]:
            assert_raises(ValueError, impl.precompute_reference_logprobs, lora_model, kind, dataset,
                          what=f"precompute_reference_logprobs(model, {kind!r}, dataset)", why=why)
