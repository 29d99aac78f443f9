"""Behavior corrections: the token weight ``w`` from ``rho = pi_prox / pi_b``, registered in
:data:`~.registry.CORRECTIONS`; :func:`behavior_weights`, which the losses call, and
:func:`batch_weight_scale`, the batch mean that ``correction_batch_normalize`` divides by."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT, masked_mean
from asyncrl.learner.algorithms.registry import CORRECTIONS, register_correction

Tensor = torch.Tensor

LEVELS = ("token", "sequence", "geometric")
"""Where rho is taken: per token; per sequence as the product of its token ratios (the
exact sequence likelihood ratio, verl's ``rollout_is: sequence``); per sequence as their
geometric mean (length-normalised, so long sequences do not explode)."""

BATCH_SCALE_EPS = 1e-8
"""Below this batch mean the weights are left unscaled (as verl): all weights masked."""

PEAK_STATS = ("importance_weight_max",)
"""Statistics of :func:`correction_weights` that are peaks: combined by max (the rest are
token means), wherever micro-batches or ranks are combined."""


@register_correction("none", uses_cap=False)
def no_correction(rho: Tensor, cap: float, floor: float) -> Tensor:
    """w = 1: trains off-policy tokens as if on-policy (an ablation)."""
    return torch.ones_like(rho)


@register_correction("tis", uses_cap=True)
def truncated_importance_sampling(rho: Tensor, cap: float, floor: float) -> Tensor:
    """w = min(rho, C)."""
    return rho.clamp(max=cap)


@register_correction("mis", uses_cap=True)
def masked_importance_sampling(rho: Tensor, cap: float, floor: float) -> Tensor:
    """w = rho where rho <= C, else 0 (the token still counts in the normalizer)."""
    return torch.where(rho > cap, torch.zeros_like(rho), rho)


@register_correction("icepop", uses_cap=True, uses_floor=True)
def icepop(rho: Tensor, cap: float, floor: float) -> Tensor:
    """w = rho where floor <= rho <= C, else 0: IcePop's two-sided mask (Ring-1T), which
    also drops tokens the learner finds far less likely than the generator did."""
    inside = (rho >= floor) & (rho <= cap)
    return torch.where(inside, rho, torch.zeros_like(rho))


@register_correction("decoupled", uses_cap=False)
def decoupled(rho: Tensor, cap: float, floor: float) -> Tensor:
    """w = rho untruncated: AReaL's decoupled PPO objective."""
    return rho


def _behavior_log_ratio(
    proximal_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, level: str
) -> Tensor:
    """log rho at ``level``, broadcast to each valid token (0 where masked), unclamped."""
    log_rho = (proximal_logprobs.float() - behavior_logprobs.float()).detach()
    log_rho = torch.where(mask, log_rho, torch.zeros_like(log_rho))
    if level == "token":
        return log_rho
    per_sequence = log_rho.sum(-1, keepdim=True)  # [B, 1]: log of the product
    if level == "geometric":
        per_sequence = per_sequence / mask.sum(-1, keepdim=True).clamp(min=1).to(log_rho.dtype)
    elif level != "sequence":
        raise ValueError(
            f"unknown correction_level {level!r}; expected one of: {', '.join(LEVELS)}"
        )
    return torch.where(mask, per_sequence.expand_as(log_rho), torch.zeros_like(log_rho))


def behavior_weights(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    *,
    correction: str = "tis",
    level: str = "token",
    cap: float = 2.0,
    floor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The detached behavior weight ``w = correction(rho)`` per token.  -> (w [B, T], stats)

    ``rho = pi_prox / pi_b`` at ``level`` (:data:`LEVELS`); the log-ratio (a sequence's
    sum or mean at the sequence levels) is clamped to +-20 before ``exp``. ``floor`` is the
    lower threshold (icepop), default ``1 / cap``. Stats over the valid tokens:
    ``importance_weight_mean`` and ``importance_weight_max`` (rho before correction),
    ``importance_truncated_frac`` (rho > C: truncated by tis, masked by mis and icepop,
    and for none/decoupled how many would be), ``importance_below_floor_frac``
    (rho < floor: masked by icepop), ``importance_applied_mean`` (mean w).
    """
    chosen = CORRECTIONS[correction]
    floor = 1.0 / cap if floor is None else floor
    if chosen.uses_floor and not 0.0 < floor < cap:
        raise ValueError(f"correction floor ({floor}) must be in (0, cap = {cap})")
    mask = mask.bool()
    log_rho = _behavior_log_ratio(proximal_logprobs, behavior_logprobs, mask, level)
    rho = log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    weight = chosen.weight(rho, cap, floor).detach()
    with torch.no_grad():
        stats = {
            "importance_weight_mean": masked_mean(rho, mask),
            "importance_weight_max": torch.where(mask, rho, torch.zeros_like(rho)).amax(),
            "importance_truncated_frac": masked_mean((rho > cap).float(), mask),
            "importance_below_floor_frac": masked_mean((rho < floor).float(), mask),
            "importance_applied_mean": masked_mean(weight, mask),
        }
    return weight, stats


def batch_weight_scale(weights: Tensor, mask: Tensor, level: str) -> Tensor:
    """The mean behavior weight of the batch, a scalar, for ``w / scale`` to average 1.

    Over the valid tokens at ``token`` level; at a sequence level over the sequences with
    a valid token, one weight each (as verl's ``rollout_is_batch_normalize``), so long
    sequences do not count more. Returns 1 when the mean is ~0 (every weight masked).
    Call it on the whole batch (all micro-batches), with the weights after correction.
    """
    if level not in LEVELS:
        raise ValueError(
            f"unknown correction_level {level!r}; expected one of: {', '.join(LEVELS)}"
        )
    with torch.no_grad():
        mask = mask.bool()
        weights = torch.where(mask, weights.float(), torch.zeros_like(weights, dtype=torch.float))
        if level == "token":
            mean = masked_mean(weights, mask)
        else:
            lengths = mask.sum(-1)
            per_sequence = weights.sum(-1) / lengths.clamp(min=1)
            mean = masked_mean(per_sequence, lengths > 0)
        return torch.where(mean > BATCH_SCALE_EPS, mean, torch.ones_like(mean))
