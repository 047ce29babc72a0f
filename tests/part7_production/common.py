"""What several of Part 7's test modules (and its wrong versions) share: the small made-up dimensions, a LoRA with
random A and B, random tokens for the tiny model, and the skips for what needs peft, accelerate or TRL."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from solutions.part2_lora import LoRA
from utils.checker.layout import ROOT

D_IN, D_OUT = 10, 12  # a block's d_model and n_heads * d_head, small: the exercises' tests need no model
D_MODEL, D_MLP = 10, 16  # with D_OUT = 12 = n_heads * d_head: the dims of the blocks peft_state_dict's tests make up

EXTRAS = "pip install -r requirements-bench.txt (trl, peft, accelerate)"
ACCELERATE_CONFIGS = ROOT / "solutions" / "production" / "accelerate_configs"


def random_lora(rank, alpha, seed, d_in=D_IN, d_out=D_OUT):
    """A LoRA whose A and B are both random (B = 0 would hide every mistake in B)."""
    g = torch.Generator().manual_seed(seed)
    lora = LoRA(d_in, d_out, rank=rank, alpha=alpha)
    with torch.no_grad():
        lora.A.copy_(torch.randn(rank, d_in, generator=g))
        lora.B.copy_(torch.randn(d_out, rank, generator=g))
    return lora


def random_tokens(seed=0):
    """A [3, 12] batch of token ids for the tiny model."""
    return torch.randint(0, 350, (3, 12), generator=torch.Generator().manual_seed(seed))


def peft_or_skip():
    """peft, or the test is skipped (with the reason) when it is not installed."""
    return pytest.importorskip("peft", reason="peft is not installed: pip install -r requirements.txt")


def needs(module: str):
    """Skip the test, with the reason, when `module` is not installed."""
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed: {EXTRAS}")
