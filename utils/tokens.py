"""Prompts into token ids: BOS first, left-padded into one batch, with a word the vocabulary lacks said once.

Its own module, below sampling and the upstream checks, which both need it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tokenize_prompts(tokenizer, prompts: list[str], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """BOS + prompt tokens, left-padded with the pad token. Returns (ids, attention_mask), both [batch, pos]."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings; wrap a single prompt as [prompt]")
    bos = tokenizer.bos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    distinct = list(dict.fromkeys(prompts))  # GRPO repeats each prompt G times: tokenize it once, all in one call
    tokens = dict(zip(distinct, tokenizer(distinct, add_special_tokens=False).input_ids))
    report_unknown_words(tokenizer, distinct, tokens)
    rows = [[bos] + tokens[p] for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids.to(device), mask.to(device)


_reported_unknown: set[str] = set()


def report_unknown_words(tokenizer, prompts: list[str], tokens: dict[str, list[int]]) -> list[str]:
    """Say once (a warning) which words of the prompts the vocabulary lacks: the tiny model's word-level tokenizer
    turns each into <unk>, which the model reads as one unknown word. Returns the new unknown words."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return []
    new = []
    for prompt in prompts:
        if unk not in tokens[prompt]:
            continue
        encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
        for token, (start, end) in zip(encoded.input_ids, encoded.offset_mapping):
            word = prompt[start:end].strip()
            if token == unk and word not in _reported_unknown:
                _reported_unknown.add(word)
                new.append(word)
    if new:
        import warnings

        warnings.warn(f"the model's vocabulary lacks {', '.join(repr(w) for w in new)}: each became the <unk> "
                      "token. The tiny model knows the words of its corpus (utils/data.py) and the digits.",
                      UserWarning, stacklevel=3)
    return new
