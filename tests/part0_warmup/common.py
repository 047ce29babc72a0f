"""Inputs that several of Part 0's test modules (and wrong versions) share: random logits and tokenised prompts."""

import torch


def random_logits(batch=3, seq=7, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, vocab, generator=g) * 2, torch.randint(0, vocab, (batch, seq), generator=g)


def prompt_tokens(model, prompts):
    bos = model.tokenizer.bos_token_id
    rows = [[bos] + model.tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    return torch.tensor(rows)
