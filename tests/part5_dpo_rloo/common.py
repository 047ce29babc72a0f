"""Part 5's shared set-up: inputs with ragged masks, the pairs the DPO tests score, and the checks several exercises'
tests make (shapes, which tokens count, a refusal checked by the function itself rather than its annotations)."""


import torch
from torch import Tensor

from tests.support import aside, expect

LORA_TARGETS = ("q", "k", "v", "o")  # the adapters of the LoRA models the DPO tests run (lora_model_with_random_B)
NAN = float("nan")
# Prompts of different lengths (left padding) and answers of different lengths (right padding); 5 pairs, so
# batch_size=2 leaves a last batch of one pair.
MIXED_TRIPLES = [("3+4=", "7", "8"), ("95+48=", "143", "133"), ("52+52=", "104", "95"), ("14+2=", "16", "26"),
                 ("71+29=", "100", "90")]


def ragged_tokens(seed=0, lengths=(7, 1, 4, 0, 2, 5)):
    """Token log-probs that are NOT zero on padding (so forgetting the mask shows), with a mask whose rows have the
    given lengths (one empty by default); 7 positions for 6 rows, so a reduction over the wrong dimension shows in
    the shape."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(len(lengths), 7, generator=g) * 3 - 0.1
    mask = torch.arange(7)[None] < torch.tensor(lengths)[:, None]
    return logprobs, mask


def fresh(*tensors):
    """Copies of the test's tensors for one call, so that a version that writes into its inputs is caught by the
    test of that property alone, not by every later comparison."""
    return tuple(t.clone() if isinstance(t, Tensor) else t for t in tensors)


def loss_and_grads(fn, *tensors, **kwargs):
    """fn's value and its gradient with respect to each tensor argument."""
    leaves = [t.clone().requires_grad_(True) for t in tensors]
    loss = fn(*leaves, **kwargs)
    loss.backward()
    return loss.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


def expect_shape(out, shape: tuple, what: str, meaning: str, wrong_dim: dict | None = None) -> None:
    """Fail early, in the learner's terms, when `out` is not a tensor of `shape` (`meaning` says what each number
    is; `wrong_dim` maps a shape to what a reduction that gives it did)."""
    got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
    because = (wrong_dim or {}).get(got)
    expect(isinstance(out, Tensor) and got == shape, what,
           f"expected a tensor of shape {shape} ({meaning}), got {got if isinstance(out, Tensor) else 'a ' + got}"
           + (f": that is the shape {because}" if because else ""), observed=got)


def expect_counts_where_mask(weights, mask, what):
    """Which positions count at all (a weight that is not 0) must be exactly the real tokens; say which way not."""
    counts = weights.detach() != 0
    if bool((counts == mask).all()):
        description = "as expected"
    elif bool((counts == ~mask).all()):
        description = "exactly the padding positions count and the real tokens do not: the mask is inverted"
    elif bool(counts.all()):
        description = "every position counts, padding included"
    elif not bool(counts.any()):
        description = "no position counts at all"
    else:
        rows = sorted({int(i) for i in (counts != mask).nonzero()[:, 0]})
        description = f"in rows {rows} the positions that count are not the real tokens"
    first = int((counts != mask).any(1).float().argmax()) if not bool((counts == mask).all()) else 0
    expect(bool((counts == mask).all()), what, f"the positions that count should be the real tokens (mask True) and "
           f"only those, but {description}. Row {first}: mask {mask[first].int().tolist()}, counts "
           f"{counts[first].int().tolist()}" + (aside("Common cause: the mask not applied (or not to this tensor).")
                                                if bool(counts.all()) else ""), observed=counts)
