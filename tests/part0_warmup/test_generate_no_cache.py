"""generate_no_cache: greedy decoding against TransformerLens's generate, and sampling with top-k and a temperature."""

import torch

from solutions import part0_warmup as ref
from tests.part0_warmup.common import prompt_tokens
from tests.support import assert_close, assert_inputs_unchanged, exercise, expect


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
    expect(distinct > 1, "64 samples of generate_no_cache(temperature=1)", "all 64 are identical: is the "
           "temperature passed on to sample_next_token (and not replaced by greedy decoding)?", observed=distinct)
