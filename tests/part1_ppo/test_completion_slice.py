"""completion_slice: the positions that choose the completion tokens, the refusal of a prompt_len out of range, the
gradient kept, and agreement with Part 0's get_logprobs."""

import pytest
import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import randn, token_batch
from tests.support import (assert_close, assert_gradients_match, assert_inputs_unchanged, assert_raises, each_refusal,
                           exercise)

pytestmark = pytest.mark.both_architectures  # each test runs on the GPT-2-style and the Llama-style tiny model


@exercise("completion_slice")
def test_completion_slice_picks_the_positions_that_choose_the_completion(impl):
    values = randn(3, 8)
    for p in (3, 1, 7):
        assert_close(impl.completion_slice(values, p), values[:, p - 1:-1], f"completion_slice(values, prompt_len={p})",
                     hint="column j must be position prompt_len - 1 + j: the position that chooses completion token j")
    logits = randn(2, 8, 5, seed=1)
    assert_close(impl.completion_slice(logits, 3), logits[:, 2:-1], "completion_slice(logits [2, 8, 5], prompt_len=3)")


@exercise("completion_slice")
def test_completion_slice_refuses_a_prompt_len_out_of_range(impl):
    x = randn(2, 6)
    with each_refusal():
        for p, why in ((0, "prompt_len = 0 has no position before the completion"),
                       (6, "prompt_len = seq leaves no completion token"),
                       (9, "prompt_len > seq")):
            assert_raises(ValueError, impl.completion_slice, x, p, what=f"completion_slice(x of seq 6, prompt_len={p})",
                          why=f"the docstring asks for 1 <= prompt_len < seq; {why}")


@exercise("completion_slice")
def test_completion_slice_keeps_the_gradient_and_the_input(impl):
    logits = randn(2, 6, 4)
    assert_gradients_match(impl.completion_slice, ref.completion_slice, (logits, 2), what="completion_slice(logits, 2)")
    assert_inputs_unchanged(impl.completion_slice, logits, 2, what="completion_slice(logits, 2)",
                            may_alias=True)  # the reference returns a view of `x` (a slice)


@exercise("completion_slice")
def test_completion_slice_agrees_with_get_logprobs(impl, tiny_model):
    ids, _ = token_batch(tiny_model, ["This is a happy dog.", "This is the dark day."])
    p = token_batch(tiny_model, ["This is"])[0].shape[1]
    with torch.no_grad():
        logits = tiny_model(ids)
    picked = impl.completion_slice(logits, p).log_softmax(-1).gather(-1, ids[:, p:, None])[..., 0]
    assert_close(picked, ref.get_logprobs(logits, ids, p), "the completion tokens' log-probs read from "
                 "completion_slice(logits, prompt_len)", hint="Part 0's get_logprobs scores the same tokens with the "
                 "same logits: the two must agree")
