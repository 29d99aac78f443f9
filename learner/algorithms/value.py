"""PPO's clipped value loss, for estimators that train a critic (``needs_values``)."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.aggregation import aggregate
from asyncrl.learner.algorithms.masked import masked_mean

Tensor = torch.Tensor


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.2,
    aggregation: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss: ``0.5 * max((v - R)^2, (clip(v, old +- clip) - R)^2)``.

    values [B, T] (with grad), old_values [B, T] (the critic when the batch's
    advantages were computed), returns [B, T] (:func:`compute_advantages`'s
    targets), mask [B, T]. The clip keeps the critic from moving further than
    ``clip`` from its old prediction in one update; ``clip=None`` gives the
    plain squared error. Stats: ``value_clip_frac`` (the clipped branch was the
    larger), ``value_error`` (mean of (v - R)^2 over valid tokens).
    """
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    values = torch.where(mask, values.float(), zeros)
    old_values = torch.where(mask, old_values.float().detach(), zeros)
    returns = torch.where(mask, returns.float().detach(), zeros)
    error = (values - returns).square()
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped_error = (clipped_values - returns).square()
        per_token = 0.5 * torch.maximum(error, clipped_error)
        clip_used = clipped_error > error
    else:
        per_token = 0.5 * error
        clip_used = torch.zeros_like(mask)
    loss = aggregate(
        per_token,
        mask,
        aggregation,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=norm_length,
    )
    with torch.no_grad():
        stats = {
            "value_clip_frac": masked_mean(clip_used.float(), mask),
            "value_error": masked_mean(error.detach(), mask),
        }
    return loss, stats
