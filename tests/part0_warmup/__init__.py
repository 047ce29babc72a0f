"""Tests of Part 0 (warm-up: log-probs, sampling, generation, steering), each run against `impl` (utils/harness.py)
and compared with the reference:

    test_get_logprobs.py          get_logprobs: the shift, log_softmax, the prefix, the gradient, the refusals
    test_sample_next_token.py     sample_next_token: greedy, temperature and top-k against the sampled frequencies
    test_generate_no_cache.py     generate_no_cache: greedy against TransformerLens's generate, sampling with top-k
    test_completion_logprobs.py   completion_logprobs: masks, padding, the gradient, a LoRAModel
    test_steering.py              make_steering_hook and steered_logprobs: the hook, its place, its clean-up
    common.py                     what several of these modules share: random logits, tokenised prompts
    mistakes.py                   the known wrong versions of each exercise, and the REGISTRY of them
    test_meta.py                  the tests of these tests (tests/meta.py)
    test_generated.py             each exercise on inputs drawn from its contract (tests/generated.py)
    test_properties.py            the property battery on each exercise it can call (tests/battery.py)
"""

from tests.part0_warmup.mistakes import REGISTRY  # noqa: F401
