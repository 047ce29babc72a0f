"""generate_no_cache: greedy decoding against TransformerLens's generate, and sampling with top-k and a temperature."""

import pytest
import torch

from solutions import part0_warmup as ref
from tests.part0_warmup.common import prompt_tokens
from tests.support import aside, assert_close, assert_inputs_unchanged, calling, exercise, expect

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


@exercise("generate_no_cache")
def test_generate_no_cache_greedy_matches_generate(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is a", "The cat is", "I feel very", "My dog is"])  # same lengths
    out = assert_inputs_unchanged(impl.generate_no_cache, tiny_model, tokens, max_new_tokens=6, temperature=0.0,
                                  what="generate_no_cache")
    expected = tiny_model.generate(tokens, max_new_tokens=6, do_sample=False, stop_at_eos=False,
                                   return_type="tokens", verbose=False)
    assert_close(out, expected, "greedy generate_no_cache(max_new_tokens=6), prompt included",
                 hint="the prompt stays at the start of each row; each new token is the argmax of the logits at the "
                      "last position, model(tokens)[:, -1], and is appended before the next step")


@exercise("generate_no_cache")
def test_generate_no_cache_with_no_new_token_returns_the_prompt(impl, tiny_model):
    """max_new_tokens=0, the bound its contract allows: no step runs, and the prompt comes back as it is."""
    tokens = prompt_tokens(tiny_model, ["This is a", "The cat is"])
    out = calling(impl.generate_no_cache, tiny_model, tokens.clone(), 0,
                  what="generate_no_cache(model, tokens, max_new_tokens=0)")
    assert_close(out, tokens, "generate_no_cache(model, tokens, max_new_tokens=0): the prompt, with no token added",
                 check_grad=False)


@exercise("generate_no_cache")
def test_generate_no_cache_samples_with_top_k(impl, tiny_model):
    tokens = prompt_tokens(tiny_model, ["This is"] * 64)
    start = torch.get_rng_state()
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=3, temperature=1.0, top_k=1)
    after = torch.get_rng_state()
    greedy = ref.generate_no_cache(tiny_model, tokens, 3, temperature=0.0)
    torch.set_rng_state(start)  # the same draws without top_k: what a version that drops top_k gives
    without_top_k = ref.generate_no_cache(tiny_model, tokens, 3, temperature=1.0)
    torch.set_rng_state(after)
    assert_close(out, greedy, "generate_no_cache(temperature=1, top_k=1)",
                 resembles={"top_k is not passed on to sample_next_token (the same draws from the whole "
                            "distribution)": without_top_k},
                 hint="with top_k=1 sampling must equal greedy decoding")
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=3, temperature=1.0)
    distinct = len({tuple(r) for r in out[:, -3:].tolist()})
    as_greedy = isinstance(out, torch.Tensor) and out.shape == greedy.shape and torch.equal(out, greedy)
    expect(distinct > 1, "64 samples of generate_no_cache(temperature=1)", "all 64 are identical"
           + (", and equal to greedy decoding's (temperature=0)" if as_greedy else "")
           + aside("Common causes: the temperature not passed on to sample_next_token, or greedy decoding used "
                   "where temperature > 0 asks for sampling."), observed=distinct)


@exercise("generate_no_cache")
def test_generate_no_cache_passes_the_temperature_on(impl, tiny_model):
    """At temperature 2 the most likely next token of "12+34=" has probability 0.24; at 1, 0.60; greedy, 1. Its
    frequency over 256 samples (a binomial standard error of at most 0.03) tells them apart."""
    tokens = prompt_tokens(tiny_model, ["12+34="] * 256)
    logits = tiny_model(tokens[:1])[0, -1]
    top = int(logits.argmax())
    out = impl.generate_no_cache(tiny_model, tokens, max_new_tokens=1, temperature=2.0)
    frequency = (out[:, -1] == top).float().mean().item()
    want, at_one = (torch.softmax(logits / t, -1)[top].item() for t in (2.0, 1.0))
    tolerance = 4 * (want * (1 - want) / len(tokens)) ** 0.5
    like_one = abs(frequency - at_one) <= 4 * (at_one * (1 - at_one) / len(tokens)) ** 0.5
    expect(abs(frequency - want) <= tolerance, "the most likely token's frequency, generate_no_cache(temperature=2)",
           f"the most likely token came {frequency:.3f} of the time, where temperature 2 gives it probability "
           f"{want:.3f} (± {tolerance:.3f}; {at_one:.3f} at temperature 1)"
           + (": the frequency that temperature 1 gives" if like_one else ""), observed=round(frequency, 3))
