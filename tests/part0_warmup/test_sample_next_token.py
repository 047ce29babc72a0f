"""sample_next_token: greedy at temperature 0, the sampled frequencies against softmax(logits / T) with top-k,
and the logits left alone."""

import pytest
import torch

from tests.part0_warmup.common import random_logits
from tests.support import aside, assert_close, assert_equal, assert_inputs_unchanged, exercise, expect


LOGITS_ROW = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def frequencies(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


@exercise("sample_next_token")
def test_sample_next_token_greedy_at_temperature_zero(impl):
    logits, _ = random_logits(batch=16, seq=1, vocab=50)
    assert_equal(impl.sample_next_token(logits[:, 0], temperature=0.0), logits[:, 0].argmax(-1),
                 "sample_next_token(temperature=0)", hint="temperature 0 means greedy: the argmax of each row")


@exercise("sample_next_token")
def test_sample_next_token_top_k_one_is_greedy(impl):
    logits, _ = random_logits(batch=16, seq=1, vocab=50, seed=1)
    assert_equal(impl.sample_next_token(logits[:, 0], temperature=1.5, top_k=1), logits[:, 0].argmax(-1),
                 "sample_next_token(temperature=1.5, top_k=1)", hint="top_k=1 leaves only the most likely token")


@exercise("sample_next_token")
@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.5, None), (2.0, None), (1.0, 3), (0.7, 2)])
def test_sample_next_token_distribution(impl, temperature, top_k):
    n, vocab = 40_000, len(LOGITS_ROW)
    out = impl.sample_next_token(LOGITS_ROW.repeat(n, 1), temperature=temperature, top_k=top_k)
    assert_equal(tuple(out.shape), (n,), f"the shape of sample_next_token's output for {n} rows")
    expected = torch.softmax(LOGITS_ROW / temperature, -1)
    if top_k is not None:
        expected[top_k:] = 0  # LOGITS_ROW is sorted, so the top k are the first k
        expected /= expected.sum()
    got = frequencies(out, vocab)
    what = f"sampled frequencies at temperature={temperature}, top_k={top_k} (expected softmax(logits / temperature)"
    what += ", renormalised over the top k)" if top_k else ")"
    if top_k is not None:
        expect(not (got[top_k:] > 0).any(), what, f"tokens outside the {top_k} most likely ones were sampled: "
               f"{got.numpy().round(3)}", observed=(got[top_k:] > 0))
        expect(not (got[:top_k] == 0).any(), what, f"some of the {top_k} most likely tokens are never sampled "
               f"({got.numpy().round(3)}): the draw collapsed onto fewer than k tokens"
               + aside("Common causes: the k-th token masked out too (<= instead of <), or greedy decoding where "
                       "sampling was asked for."),
               observed=(got[:top_k] == 0))

    def top_k_of(probs):
        if top_k is None:
            return probs
        probs = probs.clone()
        probs[top_k:] = 0
        return probs / probs.sum()

    greedy = torch.zeros(vocab)
    greedy[0] = 1.0
    wrong = {
        "the logits are multiplied by the temperature instead of divided by it":
            top_k_of(torch.softmax(LOGITS_ROW * temperature, -1)),
        "the temperature is ignored (sampled from softmax(logits))": top_k_of(torch.softmax(LOGITS_ROW, -1)),
        "every draw is the most likely token (greedy), although temperature > 0 asks for sampling": greedy,
        "top_k is ignored": torch.softmax(LOGITS_ROW / temperature, -1),
    }
    assert_close(got, expected, what, atol=0.015, rtol=0,
                 resembles={k: v for k, v in wrong.items() if (v - expected).abs().max() > 0.05})


@exercise("sample_next_token")
def test_sample_next_token_leaves_the_logits_alone(impl):
    logits, _ = random_logits(batch=8, seq=1, vocab=20, seed=4)
    assert_inputs_unchanged(impl.sample_next_token, logits[:, 0].clone(), 0.5, 3,
                            what="sample_next_token(temperature=0.5, top_k=3)")
