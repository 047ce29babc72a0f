"""completion_logprobs: the completion tokens' log-probs with the attention mask, 0 after the first EOS, the same
whatever the padding, with the gradient reaching the weights, and on a LoRAModel (Part 2 on)."""

import pytest
import torch

from solutions import part0_warmup as ref
from tests.part0_warmup import mistakes
from tests.support import (assert_close, assert_gradients_match, assert_inputs_unchanged, exercise,
                           lora_model_with_random_B)
from utils.sampling import Samples, completion_mask_from_ids, sample

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


def samples_with_eos_in_the_middle(model) -> Samples:
    """Two hand-made rows whose completions stop early, followed by junk that must not count."""
    tok = model.tokenizer
    eos = tok.eos_token_id
    s = sample(model, ["This is", "My dog is"], max_new_tokens=1, temperature=0.0)
    body = torch.tensor([tok(" a big dog.", add_special_tokens=False).input_ids,
                         tok(" very good. The", add_special_tokens=False).input_ids])
    completion = torch.cat([body[:, :2], torch.full((2, 1), eos), body[:, 2:]], dim=1)  # EOS, then junk
    cmask = completion_mask_from_ids(completion, eos)
    ids = torch.cat([s.ids[:, :s.prompt_len], completion], dim=1)
    attn = torch.cat([s.attention_mask[:, :s.prompt_len], cmask.long()], dim=1)
    return Samples(ids=ids, attention_mask=attn, completion_mask=cmask, prompt_len=s.prompt_len,
                   prompts=s.prompts, texts=["", ""], eos_id=eos)


@exercise("completion_logprobs")
def test_completion_logprobs_matches_reference(impl, tiny_model):
    samples = sample(tiny_model, ["This is", "The small dog", "12+34=", "My"], max_new_tokens=12)
    with torch.no_grad():
        got = assert_inputs_unchanged(impl.completion_logprobs, tiny_model, samples, what="completion_logprobs")
        assert_close(got, ref.completion_logprobs(tiny_model, samples), "completion_logprobs",
                     mask=samples.completion_mask, atol=1e-4)


@exercise("completion_logprobs")
def test_completion_logprobs_zero_after_first_eos(impl, tiny_model):
    samples = samples_with_eos_in_the_middle(tiny_model)
    with torch.no_grad():
        assert_close(impl.completion_logprobs(tiny_model, samples), ref.completion_logprobs(tiny_model, samples),
                     "completion_logprobs with an EOS in the middle", mask=samples.completion_mask, atol=1e-4,
                     hint="the EOS itself counts (choosing to stop is part of the completion); what follows it is 0")


@exercise("completion_logprobs")
def test_completion_logprobs_padding_does_not_matter(impl, tiny_model):
    """A row's log-probs must not depend on how much left padding its batch-mates forced on it."""
    batch = sample(tiny_model, ["The", "It was a very calm day, and the"], max_new_tokens=6, temperature=0.0)
    alone = sample(tiny_model, ["The"], max_new_tokens=6, temperature=0.0)
    with torch.no_grad():
        a = impl.completion_logprobs(tiny_model, batch)[0]
        b = impl.completion_logprobs(tiny_model, alone)[0]
    with torch.no_grad():  # what running the model without the attention mask gives (the usual cause)
        unmasked = mistakes._completion_logprobs_no_attention_mask(tiny_model, batch)[0]
    assert_close(a, b, "completion_logprobs of 'The ...' left-padded in a batch, against alone", atol=1e-4,
                 resembles={"the model is run without the attention mask (pass attention_mask=samples."
                            "attention_mask)": unmasked},
                 hint="a row's log-probs must not depend on the left padding its batch-mates force on it")


@exercise("completion_logprobs")
def test_completion_logprobs_gradient_reaches_the_weights(impl, tiny_model):
    samples = sample(tiny_model, ["This is", "12+34="], max_new_tokens=5)
    assert_gradients_match(impl.completion_logprobs, ref.completion_logprobs, (tiny_model, samples),
                           what="completion_logprobs", modules={"model": tiny_model}, atol=1e-4)


@exercise("completion_logprobs")
def test_completion_logprobs_of_a_lora_model(impl, tiny_model):
    """Part 2 on pass a LoRAModel: the adapters must be part of the scoring."""
    lora_model = lora_model_with_random_B(tiny_model)
    samples = sample(lora_model, ["This is", "23+45="], max_new_tokens=6)
    with torch.no_grad():
        assert_close(impl.completion_logprobs(lora_model, samples), ref.completion_logprobs(lora_model, samples),
                     "completion_logprobs of a LoRAModel", mask=samples.completion_mask, atol=1e-4,
                     resembles={"the adapters are left out (these are the base model's log-probs): call the model "
                                "itself, model(ids, attention_mask=...), whose forward pass applies a LoRAModel's "
                                "adapters": ref.completion_logprobs(tiny_model, samples)},
                     hint="a LoRAModel's log-probs are those of the adapted model")
