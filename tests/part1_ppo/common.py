"""What several of Part 1's test modules share: random inputs (masks, tensors, batches of tokens, a LoRA model),
the factors a scalar averaged over the valid tokens may be off by, and the set-up of the PPO loop's tests."""

import torch
import torch.nn as nn

from solutions import part1_ppo as ref
from tests.support import lora_model_with_random_B


# --- inputs ------------------------------------------------------------------------------------------------

def random_mask(batch=4, gen=7, seed=0):
    """Completion masks with the first EOS at random places (row 0 never stops, row 1 stops at once)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, gen + 1, (batch,), generator=g)
    lengths[0], lengths[1] = gen, 1
    return torch.arange(gen)[None, :] < lengths[:, None]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def leaf(t):
    """A fresh copy of `t` that autograd tracks: the reference's outputs then carry a gradient, so a learner's value
    cut off from the graph (.item(), torch.tensor, no_grad) is seen."""
    return t.detach().clone().requires_grad_(True)


def token_batch(model, texts, pad_left=0):
    tok = model.tokenizer
    rows = [[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids for t in texts]
    width = max(map(len, rows)) + pad_left
    ids = torch.full((len(rows), width), tok.eos_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def make_lora_model(base, seed=0, rank=4):
    """Part 2's LoRAModel on `base` (LoRA on q, k, v and o, alpha 16), with random B (B = 0 would leave the logits
    unchanged and hide every mistake)."""
    return lora_model_with_random_B(base, seed, rank=rank, alpha=16.0, targets=("q", "k", "v", "o"), reseed=True)


def token_factors(mask):
    """Named factors for a scalar averaged over the valid tokens (the checker cannot take them from the mask of a
    scalar): a sum where a mean was asked for, a mean over every position, or over the completions."""
    real, total, batch = int(mask.sum()), mask.numel(), mask.shape[0]
    return {f"{real} (the number of valid tokens: summed where a mean over them was asked for)": float(real),
            f"{real}/{total} (valid tokens / all positions: averaged over padding too)": real / total,
            f"{real}/{batch} (valid tokens / completions: divided by the batch size, not by the number of valid "
            "tokens)": real / batch}


def kl_inputs(seed=0, vocab=6):
    mask = random_mask(seed=seed)
    return randn(4, 7, vocab, seed=seed), randn(4, 7, vocab, seed=seed + 1) * 1.5, mask


def vocab_factors(vocab):
    return {f"1/{vocab} (one over the vocabulary size: a mean over the vocabulary, not a sum)": 1 / vocab,
            f"{vocab} (the vocabulary size)": float(vocab)}


# --- the loop: rollout and learn ---------------------------------------------------------------------------

LOOP_PROMPTS = ("This is", "The", "We", "My friend")


def length_reward(texts):
    """Characters per completion: a reward that differs from sample to sample (equal rewards would normalise to 0
    and hide most mistakes)."""
    return torch.tensor([float(len(t)) for t in texts])


def loop_config(**overrides):
    """A tiny run: 4 samples of at most 6 tokens, minibatches of 2, 2 epochs, steps big enough to see."""
    settings = dict(batch_size=4, minibatch_size=2, epochs=2, max_new_tokens=6, lr_model=1e-3, lr_head=1e-2,
                    warmup_steps=2, value_hidden=16)
    return ref.PPOConfig(**(settings | overrides))


class CountingModel(nn.Module):
    """A model that counts its forward passes and is otherwise the model it wraps."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.calls = model, 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def loop_models(tiny_model, case):
    """(policy, reference) for a rollout. "lora": the policy is a LoRA model (random B), the reference its own base
    with no hooks (Part 2). "full": the policy is the bare model and the reference another model (the same base
    with a frozen adapter of its own, Part 4's "old adapter" form), so that the two differ from the start."""
    if case == "lora":
        policy_model, reference = make_lora_model(tiny_model, seed=0), tiny_model
    else:
        policy_model, reference = tiny_model, make_lora_model(tiny_model, seed=1)
    torch.manual_seed(7)
    return ref.PolicyWithValueHead(policy_model, d_hidden=16), CountingModel(reference)


def gradient_sweep_finding(got, want, label) -> str | None:
    """For a gradient over a sweep of inputs: the positions where it differs from the reference's, each named by
    label(row, column) (measured: a finding). None where they agree or cannot be compared (the comparison itself then
    says why). The rule of when a token gets which gradient is the test's aside (hint=), not part of this."""
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape):
        return None
    bad = ~torch.isclose(got, want, atol=1e-7)
    if not bad.any():
        return None
    where = [label(i, j) for i, j in bad.nonzero().tolist()]
    return f"The gradient differs at {', '.join(where[:4])}{', ...' if len(where) > 4 else ''}."


def value_head_hooks(policy):
    """For the loop's trace (utils/checker/trace.py): the hook points of a forward pass of the policy, in the
    learner's terms (a hook point can have several names: the value head's is also blocks.{n_layers - 1}.hook_out)."""
    base = getattr(policy.model, "base", policy.model)
    head = base.hook_dict[policy.hook_name]

    def describe(names):
        if not names:
            return "no hooks"
        others = sorted(n for n in names if base.hook_dict.get(n) is not head)
        parts = (["the value head's hook"] if len(others) < len(names) else []) + \
            ([f"{len(others)} other hooks (LoRA's)"] if others else [])
        return " and ".join(parts)
    return describe
