"""Masked reductions: means and whitening over the valid tokens only."""

from __future__ import annotations

import torch

Tensor = torch.Tensor

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` so no ratio overflows (as verl does)."""

WHITEN_EPS = 1e-8
"""Added to the variance before the square root, as verl's ``masked_whiten``."""


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over positions where ``mask`` is set; 0 (not NaN) when nothing is set."""
    mask = mask.bool()
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1).to(values.dtype)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = WHITEN_EPS) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the valid tokens of the batch; 0 where masked.

    verl's ``masked_whiten`` (shift_mean on): the variance is the *unbiased* one (Bessel,
    ``n - 1``) and ``eps`` sits inside the square root. Where verl raises (no valid token,
    or one) this returns zeros: a lone value has no spread to whiten by. Values that are
    all equal also give exact zeros (verl: the mean's rounding error times 1e4).
    """
    mask = mask.bool()
    zeros = torch.zeros_like(values, dtype=torch.float32)
    if values.numel() == 0:
        return zeros
    values = torch.where(mask, values.float(), zeros)
    count = mask.sum()
    mean = values.sum() / count.clamp(min=1)
    centered = torch.where(mask, values - mean, zeros)
    variance = centered.square().sum() / (count - 1).clamp(min=1)
    highest = torch.where(mask, values, values.new_full((), -torch.inf)).amax()
    lowest = torch.where(mask, values, values.new_full((), torch.inf)).amin()
    whitened = centered * torch.rsqrt(variance + eps)
    return torch.where(highest > lowest, whitened, zeros)
