"""reference_logprobs: the base model's log-probs (no LoRA hooks, no gradient), no forward pass at all when
beta is 0, and the LoRA model, its hooks and the samples left as they were."""

import pytest
import torch

from solutions.part0_warmup import completion_logprobs
from tests.part3_grpo.common import async_reward_cause, lora_model_with_random_B
from tests.support import (assert_close, assert_equal, assert_hooks_clean, assert_inputs_unchanged, calling, exercise,
                           expect)
from utils.sampling import Samples, completion_mask_from_ids, tokenize_prompts

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def synthetic_samples(model) -> Samples:
    """Four left-padded prompts with completions of every kind: EOS early, EOS at the start, EOS last, no EOS."""
    tok = model.tokenizer
    eos = tok.eos_token_id
    prompts = ["12+34=", "This is", "The", "7+5="]
    ids, attn = tokenize_prompts(tok, prompts, "cpu")
    g = torch.Generator().manual_seed(0)
    completion = torch.randint(0, eos, (4, 6), generator=g)
    completion[0, 2], completion[1, 0], completion[2, 5] = eos, eos, eos
    cmask = completion_mask_from_ids(completion, eos)
    completion = torch.where(cmask, completion, eos)
    return Samples(ids=torch.cat([ids, completion], 1), attention_mask=torch.cat([attn, cmask.long()], 1),
                   completion_mask=cmask, prompt_len=ids.shape[1], prompts=prompts, texts=[""] * 4, eos_id=eos)


@exercise("reference_logprobs")
def test_reference_logprobs_are_the_base_models(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    samples = synthetic_samples(tiny_model)
    with torch.no_grad():
        base = completion_logprobs(tiny_model, samples)
    for beta in (0.1, 1.0):
        got = calling(impl.reference_logprobs, lora_model, samples, beta, what=f"reference_logprobs(beta={beta})",
                      explain=async_reward_cause)
        assert_close(got, base, f"reference_logprobs(LoRA model, samples, beta={beta}): the base model's log-probs of "
                     "the completions (0 after each first EOS)", mask=samples.completion_mask,
                     factors={"beta": beta} if beta != 1 else None,
                     hint="The reference is the LoRA model's base run with no hooks; the log-probs are constants for "
                          "the optimiser (no gradient).")


@exercise("reference_logprobs")
def test_reference_logprobs_with_beta_zero_run_no_forward_pass(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    samples = synthetic_samples(tiny_model)
    passes = []
    tiny_model.add_hook("hook_embed", lambda x, hook: passes.append(1))
    out = impl.reference_logprobs(lora_model, samples, 0.0)
    expect(out is None, "reference_logprobs(beta=0.0)", f"expected None (the KL term is off, there is no reference), "
           f"got {type(out).__name__}", observed=type(out).__name__)
    assert_equal(len(passes), 0, "forward passes made by reference_logprobs(beta=0.0)",
                 hint="With beta == 0 the right amount of reference computation is none: return None first.")


@exercise("reference_logprobs")
def test_reference_logprobs_leave_the_model_and_samples_alone(impl, tiny_model):
    lora_model = lora_model_with_random_B(tiny_model, seed=1)
    samples = synthetic_samples(tiny_model)
    with torch.no_grad():
        policy_before = completion_logprobs(lora_model, samples)
    assert_inputs_unchanged(impl.reference_logprobs, lora_model, samples, 0.1, what="reference_logprobs")
    with torch.no_grad():
        policy_after = completion_logprobs(lora_model, samples)
    assert_close(policy_after, policy_before, "the LoRA model's own log-probs after reference_logprobs ran",
                 mask=samples.completion_mask, hint="Computing the reference must leave the LoRA model as it was "
                 "(its adapters, their scale, its hooks): it is the policy being trained.")
    assert_hooks_clean(lora_model, lambda: impl.reference_logprobs(lora_model, samples, 0.1),
                       "reference_logprobs(LoRA model)")
