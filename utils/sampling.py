"""Batched sampling with the KV cache, returning everything RL needs to score and train on the samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from utils.decoder import lean_decoder, unsupported_reason
from utils.tokens import tokenize_prompts
from utils.upstream import require_cached_generate


@dataclass
class Samples:
    """A batch of prompts and their sampled completions, left-padded into one tensor.

    Row i is `prompts[i]` (left-padded to `prompt_len` columns) followed by its completion. Everything after
    a completion's first EOS is padding: `completion_mask` is False there, and log-probs, KL, entropy and
    value losses must ignore those positions.
    """

    ids: Int[Tensor, "batch seq"]                 # prompt + completion token ids
    attention_mask: Int[Tensor, "batch seq"]      # 1 on real tokens: prompt (not its padding) + completion
    completion_mask: Bool[Tensor, "batch gen"]    # True up to and including the first EOS of each completion
    prompt_len: int                               # ids[:, prompt_len:] is the completion
    prompts: list[str]
    texts: list[str]                              # completions decoded, cut at the first EOS
    eos_id: int                                   # the tokenizer's EOS (= BOS = PAD) id

    @property
    def completion_ids(self) -> Int[Tensor, "batch gen"]:
        return self.ids[:, self.prompt_len:]

    @property
    def truncated(self) -> Bool[Tensor, "batch"]:
        """Rows whose completion hit max_new_tokens without an EOS."""
        eos = self.completion_ids == self.eos_id
        return ~(eos & self.completion_mask).any(dim=1)


def completion_mask_from_ids(completion_ids: Int[Tensor, "batch gen"], eos_id: int) -> Bool[Tensor, "batch gen"]:
    """True on every completion token up to and including the first EOS; False after it."""
    is_eos = completion_ids == eos_id
    eos_before = is_eos.int().cumsum(dim=1) - is_eos.int()  # how many EOS came strictly before each position
    return eos_before == 0


@torch.no_grad()
def sample(model, prompts: list[str], max_new_tokens: int = 16, temperature: float = 1.0,
           top_k: int | None = None, stop_at_eos: bool = True, engine: str = "auto") -> Samples:
    """Sample one completion per prompt with the KV cache; hooks added with `model.hooks(...)` stay active.

    temperature=0 means greedy decoding. To sample G completions of a prompt, repeat it G times in `prompts`.
    stop_at_eos=False always runs max_new_tokens steps (benchmarks use it for equal work); the completion mask
    still ends at each row's first EOS.

    engine: "bridge" decodes with TransformerLens's `generate`, through every hook point, honouring every hook;
    "lean" with `utils.decoder`'s LeanGPT2 or LeanLlama, the same function in a dozen operations per layer, which reads the
    bridge's weights (plus a LoRA model's `weight_updates()`, merged) and refuses to run while a hook is active;
    "auto" (the default) takes "lean" whenever it can compute exactly what "bridge" would, else "bridge". Before the
    first decode through the bridge, the installed libraries' cached `generate` is checked against a full recompute
    (`utils.upstream.require_cached_generate`): EnvironmentMismatch, naming the versions, if they disagree.
    """
    if not temperature >= 0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None (the whole vocabulary) or a whole number >= 1, got {top_k!r}")
    if engine not in ("auto", "lean", "bridge"):
        raise ValueError(f"engine must be 'auto', 'lean' or 'bridge', got {engine!r}")
    tokenizer = model.tokenizer
    eos = tokenizer.eos_token_id
    ids, attn = tokenize_prompts(tokenizer, prompts, model.cfg.device)
    n_ctx = model.cfg.n_ctx
    if ids.shape[1] + max_new_tokens > n_ctx:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context of {n_ctx} tokens: shorten the prompt or lower max_new_tokens")
    base = getattr(model, "base", model)  # a LoRA model's base module, which the lean decoder reads
    if engine == "bridge":
        why_not = "engine='bridge' was asked for"
    elif base is not model and not hasattr(model, "weight_updates"):  # a wrapper whose changes we cannot see
        why_not = f"{type(model).__name__} wraps its base model but has no weight_updates() to merge"
    else:
        why_not = unsupported_reason(base)
    if engine == "lean" and why_not:
        raise ValueError(f"engine='lean' cannot sample from this model: {why_not}. Use engine='bridge' (or 'auto').")
    if why_not is None:
        updates = model.weight_updates() if hasattr(model, "weight_updates") else {}
        completion = lean_decoder(base, updates).generate(ids, attn, max_new_tokens, temperature, top_k, eos,
                                                      stop_at_eos)
        out = torch.cat([ids, completion], dim=1)
    else:
        require_cached_generate()  # never sample from a wrong distribution in silence (utils/upstream.py)
        out = model.generate(ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                             temperature=temperature if temperature > 0 else 1.0, top_k=top_k,
                             stop_at_eos=stop_at_eos, eos_token_id=eos, return_type="tokens", verbose=False)
    prompt_len = ids.shape[1]
    completion = out[:, prompt_len:]
    cmask = completion_mask_from_ids(completion, eos)
    completion = torch.where(cmask, completion, torch.full_like(completion, eos))  # tidy: pad with EOS
    full = torch.cat([ids, completion], dim=1)
    attention_mask = torch.cat([attn, cmask.long()], dim=1)
    texts = tokenizer.batch_decode([[t for t, keep in zip(row, m) if keep and t != eos]
                                    for row, m in zip(completion.tolist(), cmask.tolist())])
    return Samples(ids=full, attention_mask=attention_mask, completion_mask=cmask, prompt_len=prompt_len,
                   prompts=list(prompts), texts=texts, eos_id=eos)
