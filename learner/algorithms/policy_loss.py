"""The clipped PPO surrogate with a behavior correction, and the corrections themselves
(registered in :data:`~.registry.CORRECTIONS`). Notation: see the package docstring."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.aggregation import aggregate
from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT, masked_mean
from asyncrl.learner.algorithms.registry import CORRECTIONS, register_correction

Tensor = torch.Tensor


@register_correction("none", uses_cap=False)
def no_correction(rho: Tensor, cap: float) -> Tensor:
    """w = 1: trains off-policy tokens as if on-policy (an ablation)."""
    return torch.ones_like(rho)


@register_correction("tis", uses_cap=True)
def truncated_importance_sampling(rho: Tensor, cap: float) -> Tensor:
    """w = min(rho, C)."""
    return rho.clamp(max=cap)


@register_correction("mis", uses_cap=True)
def masked_importance_sampling(rho: Tensor, cap: float) -> Tensor:
    """w = rho where rho <= C, else 0 (the token still counts in the normalizer)."""
    return torch.where(rho > cap, torch.zeros_like(rho), rho)


@register_correction("decoupled", uses_cap=False)
def decoupled(rho: Tensor, cap: float) -> Tensor:
    """w = rho untruncated: AReaL's decoupled PPO objective."""
    return rho


def _behavior_log_ratio(
    proximal_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, level: str
) -> Tensor:
    """log(pi_prox / pi_b) per token, or per sequence (the log of the geometric mean)."""
    log_rho = (proximal_logprobs.float() - behavior_logprobs.float()).detach()
    log_rho = torch.where(mask, log_rho, torch.zeros_like(log_rho))
    if level == "token":
        return log_rho
    if level == "sequence":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1).to(log_rho.dtype)
        per_sequence = log_rho.sum(-1, keepdim=True) / lengths  # [B, 1]
        return torch.where(mask, per_sequence.expand_as(log_rho), torch.zeros_like(log_rho))
    raise ValueError(f"unknown correction_level {level!r}; expected one of: token, sequence")


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    correction: str = "tis",
    correction_level: str = "token",
    correction_cap: float = 2.0,
    aggregation: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate with a behavior correction.  -> (loss, stats)

    logprobs [B, T] (with grad: pi_theta), proximal_logprobs [B, T] (pi_prox),
    behavior_logprobs [B, T] (pi_b, as the generator recorded them),
    advantages [B, T] ([B] is broadcast), mask [B, T].

    The generator's tokens come from pi_b, which may be several versions old
    (and is numerically a different engine), so the loss weights each token
    by ``w = correction(pi_prox / pi_b)`` (detached):

    - ``none``: w = 1. Trains off-policy tokens as if on-policy — an ablation;
    - ``tis``: w = min(rho, C), truncated importance sampling;
    - ``mis``: w = rho where rho <= C, else 0 (the token drops out of the
      loss but still counts in the normalizer, which is global);
    - ``decoupled``: w = rho untruncated, AReaL's decoupled PPO objective.
      The trainer recomputes ``proximal_logprobs`` with one extra forward pass
      at the start of the update; with one optimizer step per batch that is
      simply the current policy, detached.

    ``correction_level="sequence"`` uses one rho per sequence, the geometric
    mean of its token ratios ``exp(mean_t log rho_t)``, truncated or masked by
    that value. The clip is asymmetric (``clip_low``, ``clip_high``, DAPO's
    clip-higher), and ``clip_c`` (> 1) adds the dual clip: for A < 0 the
    surrogate is at least ``clip_c * A``, so a huge ratio on a bad token cannot
    blow up the loss. See :func:`aggregate` for ``aggregation`` and the global
    normalizers. Log-ratios are clamped to +-20 before ``exp``.

    Stats (detached, over this call's valid tokens): ``clip_frac`` (the clip
    removed the gradient), ``dual_clip_frac``, ``importance_weight_mean`` and
    ``importance_weight_max`` (rho before correction, at the chosen level),
    ``importance_truncated_frac`` (rho > C: truncated by tis, masked by mis,
    and for none/decoupled how many would be), ``importance_applied_mean``
    (mean w), ``ppo_kl`` (k3 estimate of KL(pi_prox || pi_theta)).
    """
    chosen = CORRECTIONS[correction]
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = torch.where(mask, advantages.float().detach().expand_as(zeros), zeros)

    log_ratio = torch.where(mask, logprobs.float() - proximal_logprobs.float().detach(), zeros)
    ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    unclipped = ratio * advantages
    clipped = clipped_ratio * advantages
    surrogate = torch.minimum(unclipped, clipped)
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"clip_c must be > 1, got {clip_c}")
        floor = clip_c * advantages
        dual = (advantages < 0) & (floor > surrogate)
        surrogate = torch.where(dual, floor, surrogate)
    else:
        dual = torch.zeros_like(mask)

    log_rho = _behavior_log_ratio(proximal_logprobs, behavior_logprobs, mask, correction_level)
    rho = log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()
    over_cap = rho > correction_cap
    weight = chosen.weight(rho, correction_cap)

    loss = aggregate(
        -weight * surrogate,
        mask,
        aggregation,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=norm_length,
    )
    with torch.no_grad():
        lr = log_ratio.detach()
        stats = {
            "clip_frac": masked_mean((clipped < unclipped).float(), mask),
            "dual_clip_frac": masked_mean(dual.float(), mask),
            "importance_weight_mean": masked_mean(rho, mask),
            "importance_weight_max": torch.where(mask, rho, torch.zeros_like(rho)).amax(),
            "importance_truncated_frac": masked_mean(over_cap.float(), mask),
            "importance_applied_mean": masked_mean(weight, mask),
            "ppo_kl": masked_mean(torch.expm1(lr.clamp(max=LOG_RATIO_LIMIT)) - lr, mask),
        }
    return loss, stats
