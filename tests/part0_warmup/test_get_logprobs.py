"""get_logprobs: each token scored by the logits of the position before it, with log_softmax; the gradient, the
inputs left alone, and the refusal of a prefix that leaves nothing to score."""

import torch

from solutions import part0_warmup as ref
from tests.part0_warmup.common import random_logits
from tests.support import (assert_close, assert_gradients_match, assert_inputs_unchanged, assert_raises, each_refusal,
                           exercise)


@exercise("get_logprobs")
def test_get_logprobs_matches_reference(impl):
    for seed in range(3):
        logits, tokens = random_logits(seed=seed)
        for prefix_len in (1, 3):
            assert_close(impl.get_logprobs(logits, tokens, prefix_len), ref.get_logprobs(logits, tokens, prefix_len),
                         f"get_logprobs(prefix_len={prefix_len})")


@exercise("get_logprobs")
def test_get_logprobs_of_a_certain_token_is_zero(impl):
    tokens = torch.tensor([[0, 1, 2, 3]])
    logits = torch.full((1, 4, 5), -1e4)
    logits[0, torch.arange(3), tokens[0, 1:]] = 1e4  # the model is certain of every next token
    assert_close(impl.get_logprobs(logits, tokens), torch.zeros(1, 3),
                 "get_logprobs where the model is certain of every next token", atol=1e-4,
                 hint="a model that is certain of each next token gives it log-prob 0")


@exercise("get_logprobs")
def test_get_logprobs_gradient_and_inputs(impl):
    logits, tokens = random_logits(seed=3)
    assert_gradients_match(impl.get_logprobs, ref.get_logprobs, (logits, tokens, 2), what="get_logprobs",
                           wrt=["logits"])
    assert_inputs_unchanged(impl.get_logprobs, logits.clone(), tokens.clone(), 2, what="get_logprobs")


@exercise("get_logprobs")
def test_get_logprobs_refuses_a_prefix_that_scores_nothing(impl):
    logits, tokens = random_logits(seq=5)
    with each_refusal():
        for prefix_len in (0, 5):
            assert_raises(ValueError, impl.get_logprobs, logits, tokens, prefix_len,
                          what=f"get_logprobs(prefix_len={prefix_len}) with 5 tokens", why="prefix_len must be in "
                          "[1, seq): nothing predicts the first token, and a prefix of the whole sequence leaves "
                          "nothing to score")
