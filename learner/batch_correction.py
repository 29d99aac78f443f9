"""The corrections decided on the whole batch before its first update.

Rejection sampling, M2PO and the batch normalisation of the behavior weights look at every
token of the batch at once (a second moment, a mean weight), so they cannot run per
micro-batch: the update computes the batch's proximal log-probs in the pre-pass
(:meth:`~.update.Update.proximal_logprobs`) and this module turns them into the loss mask
the update trains on (the rejected tokens leave the loss *and* its normalizers, as in
verl) and the scale the behavior weights are divided by.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.config import AlgorithmConfig
from asyncrl.learner.algorithms import (
    batch_weight_scale,
    behavior_weights,
    m2po_keep,
    rejection_keep,
)

Tensor = torch.Tensor


@dataclass(frozen=True)
class BatchCorrection:
    """What the whole-batch corrections decided for one batch."""

    loss_mask: Tensor
    """The batch's loss mask [B, L-1] less the rejected tokens (same dtype)."""
    weight_scale: float = 1.0
    """The behavior weights are divided by this (1: not normalised)."""
    metrics: dict[str, float] = field(default_factory=dict)


def correct_batch(
    algorithm: AlgorithmConfig, proximal: Tensor, behavior: Tensor, loss_mask: Tensor
) -> BatchCorrection:
    """Rejection sampling, then M2PO on the tokens left, then the batch's weight scale.

    ``proximal`` and ``behavior`` are the batch's [B, L-1] log-probs, ``loss_mask`` its
    mask; nothing configured: the mask unchanged, scale 1, no metrics.
    """
    keep = loss_mask.bool()
    metrics: dict[str, float] = {}
    if algorithm.rejection:
        kept, stats = rejection_keep(proximal, behavior, keep, algorithm.rejection)
        keep = keep & kept
        metrics |= {key: float(value) for key, value in stats.items()}
    if algorithm.m2po_threshold is not None:
        kept, stats = m2po_keep(proximal, behavior, keep, algorithm.m2po_threshold)
        keep = keep & kept
        metrics |= {key: float(value) for key, value in stats.items()}
    scale = 1.0
    if algorithm.correction_batch_normalize:
        weights, _ = behavior_weights(
            proximal,
            behavior,
            keep,
            correction=algorithm.correction,
            level=algorithm.correction_level,
            cap=algorithm.correction_cap,
            floor=algorithm.correction_floor,
        )
        scale = float(batch_weight_scale(weights, keep, algorithm.correction_level))
        metrics["importance_batch_scale"] = scale
    return BatchCorrection(keep.to(loss_mask.dtype), scale, metrics)
