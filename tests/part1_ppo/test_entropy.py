"""entropy: -sum p log p in nats over the vocabulary, on the valid tokens, with its gradient."""

import math

import torch

from solutions import part1_ppo as ref
from tests.part1_ppo.common import kl_inputs, leaf, vocab_factors
from tests.support import assert_close, assert_gradients_match, assert_inputs_unchanged, exercise


@exercise("entropy")
def test_entropy(impl):
    logits, _, mask = kl_inputs(seed=4)
    assert_close(impl.entropy(leaf(logits), mask), ref.entropy(leaf(logits), mask), "entropy(logits, mask)", mask=mask,
                 factors=vocab_factors(6) | {"1/ln 2 (bits, where nats are asked for)": 1 / math.log(2)},
                 hint="H = -sum over the vocabulary of p log p, in nats")
    assert_close(impl.entropy(torch.zeros(1, 1, 8), torch.ones(1, 1, dtype=torch.bool)),
                 torch.tensor([[math.log(8.0)]]), "entropy of a uniform distribution over 8 tokens",
                 hint="a uniform distribution over 8 tokens has entropy log 8 = 2.079 nats")


@exercise("entropy")
def test_entropy_gradient_and_inputs(impl):
    logits, _, mask = kl_inputs(seed=5)
    assert_gradients_match(impl.entropy, ref.entropy, (logits, mask), what="entropy")
    assert_inputs_unchanged(impl.entropy, logits, mask, what="entropy")
