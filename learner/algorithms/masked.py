"""Masked reductions: means and whitening over the valid tokens only."""

from __future__ import annotations

import torch

Tensor = torch.Tensor

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` so no ratio overflows (as verl does)."""


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over positions where ``mask`` is set; 0 (not NaN) when nothing is set."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the valid tokens of the batch; 0 where masked.

    The std is the population std (no Bessel correction). One valid token, or
    all-equal values, whiten to 0.
    """
    mask = mask.bool()
    mean = masked_mean(values, mask)
    centered = torch.where(mask, values - mean, torch.zeros_like(values))
    std = masked_mean(centered.square(), mask).sqrt()
    return centered / (std + eps)
