"""old_adapter_logprobs: the log-probs of the base with an old (frozen) adapter in place of the live ones, of
any rank, leaving the LoRAModel, its flags and its hooks as they were."""

import pytest
import torch

from solutions import part4_reference as ref
from solutions.part2_lora import LoRAModel
from tests.part4_reference.common import (RANK, flags_unchanged, padded_rows, padded_samples,
                                          trained_adapters)
from tests.support import assert_close, assert_hooks_clean, assert_inputs_unchanged, exercise, expect

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def retraining(tiny_model, seed):
    """A LoRAModel whose adapters have moved on since the old adapter was copied, and samples of it."""
    adapters = trained_adapters(tiny_model, seed=seed)
    lora_model = LoRAModel(tiny_model, adapters)
    old = ref.frozen_adapter_copy(adapters)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for a in adapters.values():  # training moved the live adapters on since
            a.A.add_(torch.randn(a.A.shape, generator=g) * 0.05)
            a.B.add_(torch.randn(a.B.shape, generator=g) * 0.1)
    return lora_model, old, padded_samples(lora_model, seed=seed)


def check_old_adapter_logprobs(impl, lora_model, old, samples, what):
    with torch.no_grad():
        expected = ref.old_adapter_logprobs(lora_model, old, samples)

    def call():
        try:
            return assert_inputs_unchanged(impl.old_adapter_logprobs, lora_model, old, samples, what=what)
        except RuntimeError as error:
            if "size mismatch" in str(error):
                expect(False, what, "the old adapter's tensors were loaded into the live adapters (or the reverse), "
                       "and their shapes differ: an old adapter need not have the live ones' rank (after a sync it "
                       "has more). Leave the live adapters alone and run lora_model.base with the old adapter's own "
                       "hooks, lora_hooks(lora_model.base, old_adapters)", observed="size mismatch")
            raise
    got = flags_unchanged({"lora_model": lora_model, "old_adapters": old}, call, what)
    finding, why = padded_rows(got, expected, samples)
    assert_close(got, expected, what, mask=samples.completion_mask, atol=1e-4, finding=finding, hint=why)


@exercise("old_adapter_logprobs")
def test_old_adapter_logprobs_are_the_base_with_the_old_adapter(impl, tiny_model):
    lora_model, old, samples = retraining(tiny_model, seed=1)
    check_old_adapter_logprobs(impl, lora_model, old, samples, "old_adapter_logprobs(lora_model, old_adapters, "
                               "samples)")


@exercise("old_adapter_logprobs")
def test_old_adapter_logprobs_with_an_old_adapter_of_another_rank(impl, tiny_model):
    """After a sync (sync_old_adapter) the old adapter has rank r + r_old and scale 1: it is its own LoRA."""
    lora_model, old, samples = retraining(tiny_model, seed=2)
    old = ref.sync_old_adapter(old, lora_model.adapters, 0.5)
    check_old_adapter_logprobs(impl, lora_model, old, samples, "old_adapter_logprobs with an old adapter of rank "
                               f"{2 * RANK} (the live ones: rank {RANK})")


@exercise("old_adapter_logprobs")
def test_old_adapter_logprobs_leaves_no_hooks(impl, tiny_model):
    lora_model, old, samples = retraining(tiny_model, seed=3)
    assert_hooks_clean(lora_model, lambda: impl.old_adapter_logprobs(lora_model, old, samples),
                       "old_adapter_logprobs")
