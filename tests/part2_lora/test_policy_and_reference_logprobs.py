"""policy_and_reference_logprobs on a LoRAModel whose adapters are trained (random B): the policy with the LoRA
hooks, the reference (the base) without, their gradients, and what they leave alone."""

import dataclasses

import pytest
import torch

from solutions import part2_lora as ref
from solutions.part0_warmup import completion_logprobs
from tests.part2_lora.common import attempt, random_adapters
from tests.support import (aside, assert_close, assert_gradients_match, assert_hooks_clean, assert_inputs_unchanged,
                           exercise, expect, reference_trace)
from utils.sampling import sample

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model

def lora_setup(model, seed=2):
    """A LoRA model as training has it: the base frozen, random (trained) adapters, and samples drawn from it."""
    model.requires_grad_(False)
    adapters = random_adapters(model, ("q", "v", "o", "mlp_in"), seed=seed)
    lora_model = ref.LoRAModel(model, adapters)
    def draw():
        torch.manual_seed(0)
        return sample(lora_model, ["This is", "The", "My friend"], max_new_tokens=12)

    # drawn once per process, model and seed (sampling is the slow part); a copy each time: a wrong version may change
    # its samples in place
    s = reference_trace(f"policy_and_reference_logprobs samples, seed {seed}", draw, model=model)
    samples = dataclasses.replace(s, ids=s.ids.clone(), attention_mask=s.attention_mask.clone(),
                                  completion_mask=s.completion_mask.clone(), prompts=list(s.prompts),
                                  texts=list(s.texts))
    return lora_model, adapters, samples


def padded_rows(got, expected, samples) -> tuple[str | None, str | None]:
    """(finding, aside): when exactly the rows whose prompt is left-padded are wrong, the finding says so (measured),
    and the aside what leaving out the attention mask does (the padding is attended to, and the positions are off),
    which that pattern does not prove. (None, None) otherwise."""
    if not (isinstance(got, torch.Tensor) and got.shape == expected.shape):
        return None, None
    wrong = ~torch.isclose(got.detach(), expected, atol=1e-5, rtol=1e-4).all(dim=1)
    padded = samples.attention_mask[:, 0] == 0
    if wrong.any() and padded.any() and torch.equal(wrong, padded):
        return (f"The wrong rows, {padded.nonzero().flatten().tolist()}, are exactly those whose prompt is "
                "left-padded.",
                "A forward pass without attention_mask=samples.attention_mask attends to the padding and puts the "
                "tokens at other positions; completion_logprobs passes it.")
    return None, None


def pair_of(out, what: str):
    expect(isinstance(out, (tuple, list)) and len(out) == 2, what, "expected a pair (policy log-probs, reference "
           f"log-probs), got {type(out).__name__}", observed=type(out).__name__)
    return out


@exercise("policy_and_reference_logprobs")
def test_reference_is_the_base_model_without_hooks(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model)
    mask = samples.completion_mask
    logprobs, ref_logprobs = pair_of(attempt("policy_and_reference_logprobs(lora_model, samples)",
                                             impl.policy_and_reference_logprobs, lora_model, samples),
                                     "what policy_and_reference_logprobs returns")
    with torch.no_grad():
        base = completion_logprobs(tiny_model, samples)
        adapted = completion_logprobs(lora_model, samples)

    def equal(a, b):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a.detach(), b, atol=1e-5)

    swapped = equal(logprobs, base) and equal(ref_logprobs, adapted)
    expect(not swapped, "the order of the pair", "the first is the reference's log-probs and the second the policy's: "
           "return (policy log-probs, reference log-probs)", observed=swapped)
    expect(not equal(ref_logprobs, adapted), "reference log-probs", "they are the LoRA model's own log-probs, where "
           "the reference is lora_model.base called with no hooks" + aside(
               "Common causes: the reference run with the LoRA hooks on (through lora_model itself, inside "
               "lora_model.adapted(), or with hooks added by add_hook still on), or a copy of the policy's "
               "log-probs."), observed=equal(ref_logprobs, adapted))
    expect(not equal(logprobs, base), "policy log-probs", "they are the base model's: the policy ran without the LoRA "
           "hooks. The policy is lora_model itself, whose forward adds them", observed=equal(logprobs, base))
    finding, why = padded_rows(ref_logprobs, base, samples)
    assert_close(ref_logprobs, base, "reference log-probs (lora_model.base, no hooks)", mask=mask, atol=1e-5,
                 finding=finding, hint=why)
    expected = completion_logprobs(lora_model, samples)
    finding, why = padded_rows(logprobs, expected.detach(), samples)
    assert_close(logprobs, expected, "policy log-probs (lora_model, with its hooks)", mask=mask, atol=1e-5,
                 finding=finding, hint=why)


@exercise("policy_and_reference_logprobs")
def test_policy_and_reference_gradients(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model, seed=3)
    assert_gradients_match(impl.policy_and_reference_logprobs, ref.policy_and_reference_logprobs,
                           (lora_model, samples), what="policy_and_reference_logprobs", modules={"adapters": adapters})


@exercise("policy_and_reference_logprobs")
def test_policy_and_reference_leave_samples_and_model_alone(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model, seed=4)
    with torch.no_grad():
        assert_inputs_unchanged(impl.policy_and_reference_logprobs, lora_model, samples,
                                what="policy_and_reference_logprobs")


@exercise("policy_and_reference_logprobs")
def test_policy_and_reference_hooks_clean(impl, tiny_model):
    lora_model, adapters, samples = lora_setup(tiny_model, seed=5)

    def call():
        with torch.no_grad():
            return impl.policy_and_reference_logprobs(lora_model, samples)

    assert_hooks_clean(lora_model, call, "policy_and_reference_logprobs")
