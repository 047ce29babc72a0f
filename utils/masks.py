"""Averages over the valid tokens of a batch of completions (True in the completion mask), written once."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor


def masked_mean(x: Float[Tensor, "..."], mask: Bool[Tensor, "..."], dim: int | None = None) -> Tensor:
    """Mean of `x` over the positions where `mask` is True (over all of them, or along `dim`). `x` and `mask` have
    the same shape: a broadcast would silently average over the wrong positions."""
    if x.shape != mask.shape:
        raise ValueError(f"masked_mean: x has shape {tuple(x.shape)} but mask {tuple(mask.shape)}; they must be the "
                         "same")
    mask = mask.to(x.dtype)
    if dim is None:
        count = mask.sum()
        if count == 0:
            raise ValueError("masked_mean over an empty mask: no valid token to average over")
        return (x * mask).sum() / count
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: Float[Tensor, "..."], mask: Bool[Tensor, "..."]) -> Tensor:
    """Variance of `x` over the valid positions (population variance, as the whitening below needs)."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_whiten(x: Float[Tensor, "..."], mask: Bool[Tensor, "..."], eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the valid positions; 0 outside them."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    return ((x - mean) * torch.rsqrt(var + eps)) * mask
