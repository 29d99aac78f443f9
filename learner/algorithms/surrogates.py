"""The policy-loss surrogates, registered in :data:`~.registry.POLICY_LOSSES` under
``algorithm.policy_loss``; :func:`~.policy_loss.policy_loss` looks one up. Notation: see
the package docstring.

Every surrogate takes the same tensors, by keyword, already masked by the caller (0 at
masked positions, so a NaN there never reaches an ``exp`` or a gradient):

- ``logprobs`` [B, T]: log pi_theta, with grad;
- ``log_ratio`` [B, T]: log(pi_theta / pi_prox), with grad, unclamped;
- ``advantages`` [B, T], ``weight`` [B, T] (the behavior weight w), both detached;
- ``mask`` [B, T] bool;

plus the knobs its entry names (each defaulting as in ``algorithm``), and returns a
:class:`Surrogate`: per-token losses that the caller aggregates (a sequence-level loss
puts its sequence's value on each of its tokens, so ``seq-mean-token-mean`` averages it
once per sequence, as verl does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT
from asyncrl.learner.algorithms.registry import register_policy_loss

Tensor = torch.Tensor

GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's per-token log sequence ratio is clamped above at 10, as verl does."""
GMPO_WEIGHT_EPS = 1e-10
"""GMPO takes the log of the behavior weights for their geometric mean: log(w + eps), verl's."""

CLIP = ("clip_low", "clip_high")
CLIP_DEFAULT = 0.2
"""``clip_low`` and ``clip_high`` where a caller gives none (``algorithm``'s defaults)."""


class Surrogate(NamedTuple):
    """What a surrogate gives :func:`~.policy_loss.policy_loss`: token losses to aggregate,
    and which tokens its clips touched (for the stats)."""

    losses: Tensor
    """[B, T] per-token loss, behavior weight applied; only valid positions count."""
    clipped: Tensor
    """[B, T] bool: the clip removed this token's gradient (cispo: truncated its weight)."""
    dual_clipped: Tensor
    """[B, T] bool: the dual clip's floor set the loss (ppo only)."""


def _none(mask: Tensor) -> Tensor:
    return torch.zeros_like(mask, dtype=torch.bool)


def _token_ratio(log_ratio: Tensor) -> Tensor:
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()


def _clipped_objective(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO's ``min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, and where the clip won
    (the tokens whose gradient it removed)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def _sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean over each row's valid tokens [B] (a row with none: 0)."""
    lengths = mask.sum(-1).clamp(min=1).to(values.dtype)
    return torch.where(mask, values, torch.zeros_like(values)).sum(-1) / lengths


@register_policy_loss("ppo", knobs=(*CLIP, "clip_c"))
def ppo_surrogate(
    *,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    clip_low: float = CLIP_DEFAULT,
    clip_high: float = CLIP_DEFAULT,
    clip_c: float | None = None,
    **_: Tensor,
) -> Surrogate:
    """``-w min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, and with ``clip_c`` (> 1)
    the dual clip: for A < 0 the surrogate is at least ``clip_c A`` (verl's vanilla)."""
    ratio = _token_ratio(log_ratio)
    surrogate, clipped = _clipped_objective(ratio, advantages, clip_low, clip_high)
    if clip_c is not None:
        if clip_c <= 1.0:
            raise ValueError(f"clip_c must be > 1, got {clip_c}")
        floor = clip_c * advantages
        dual = (advantages < 0) & (floor > surrogate)
        surrogate = torch.where(dual, floor, surrogate)
    else:
        dual = _none(mask)
    return Surrogate(-weight * surrogate, clipped, dual)


@register_policy_loss("gspo", knobs=CLIP)
def gspo_surrogate(
    *,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    clip_low: float = CLIP_DEFAULT,
    clip_high: float = CLIP_DEFAULT,
    **_: Tensor,
) -> Surrogate:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071; verl's ``gspo``): the PPO clip on the
    sequence ratio ``s = exp(mean_t log r_t)``, taken per token as
    ``s_t = sg(s) * pi_theta_t / sg(pi_theta_t)``: its value is s on every token of the
    sequence, its gradient that of ``s * log pi_theta_t`` (GSPO-token). The log of s_t is
    clamped above at 10 (verl's)."""
    log_sequence = _sequence_mean(log_ratio, mask).detach().unsqueeze(-1)
    log_s = (log_ratio - log_ratio.detach() + log_sequence).clamp(max=GSPO_LOG_RATIO_MAX)
    surrogate, clipped = _clipped_objective(log_s.exp(), advantages, clip_low, clip_high)
    return Surrogate(-weight * surrogate, clipped, _none(mask))


@register_policy_loss("cispo", knobs=CLIP)
def cispo_surrogate(
    *,
    logprobs: Tensor,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    clip_low: float = CLIP_DEFAULT,
    clip_high: float = CLIP_DEFAULT,
    **_: Tensor,
) -> Surrogate:
    """CISPO (MiniMax-M1, arXiv 2506.13585; verl's ``cispo``):
    ``-w sg(clip(r, 1 - clip_low, 1 + clip_high)) A log pi_theta``. The clip only bounds
    a stop-gradient weight, so every token keeps its gradient; ``clipped`` marks the
    tokens whose weight it truncated (verl's ``pg_clipfrac`` for cispo)."""
    ratio = _token_ratio(log_ratio).detach()
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = -clipped_ratio * advantages * logprobs * weight
    return Surrogate(losses, ratio != clipped_ratio, _none(mask))


@register_policy_loss("sapo", knobs=("sapo_tau_pos", "sapo_tau_neg"))
def sapo_surrogate(
    *,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    **_: Tensor,
) -> Surrogate:
    """SAPO (Gao et al. 2025, arXiv 2511.20347; verl's ``sapo``): the hard clip replaced by
    the soft gate ``f(r) = sigmoid(tau (r - 1)) 4 / tau``, loss ``-w f(r) A``, with
    ``tau = sapo_tau_pos`` where A > 0, else ``sapo_tau_neg``. On-policy the gate's slope
    is 1, so the gradient is PPO's; it decays smoothly as r leaves 1. Never clips."""
    ratio = _token_ratio(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.full_like(ratio, sapo_tau_pos),
        torch.full_like(ratio, sapo_tau_neg),
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return Surrogate(-gate * advantages * weight, _none(mask), _none(mask))


@register_policy_loss("gmpo", knobs=CLIP)
def gmpo_surrogate(
    *,
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    clip_low: float = CLIP_DEFAULT,
    clip_high: float = CLIP_DEFAULT,
    **_: Tensor,
) -> Surrogate:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673; verl's ``geo_mean``), per sequence:
    ``-w_seq A_seq exp(mean_t c_t)`` with ``c_t = sign(A_t) min(sign(A_t) log r_t,
    sign(A_t) clip(log r_t, -clip_low, clip_high))``, the token log-ratio clipped in log
    space on the side that would grow the objective; ``A_seq`` is the sequence's mean
    advantage and ``w_seq = exp(mean_t log(w_t + 1e-10))`` the geometric mean of its
    behavior weights. The sequence's loss sits on each of its tokens. Log-ratios are
    clamped to +-20 first (verl leaves them unclamped)."""
    log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    sign = advantages.sign()
    kept = sign * log_ratio
    bounded = sign * log_ratio.clamp(-clip_low, clip_high)
    clipped_log_ratio = sign * torch.minimum(kept, bounded)
    ratio = _sequence_mean(clipped_log_ratio, mask).exp()
    sequence_weight = _sequence_mean(torch.log(weight + GMPO_WEIGHT_EPS), mask).exp()
    sequence_loss = -_sequence_mean(advantages, mask) * ratio * sequence_weight
    losses = sequence_loss.unsqueeze(-1).expand_as(log_ratio)
    return Surrogate(losses, bounded < kept, _none(mask))


@register_policy_loss("reinforce", knobs=())
def reinforce_surrogate(
    *,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    **_: Tensor,
) -> Surrogate:
    """Importance-weighted REINFORCE, ``-w A log pi_theta``: no ratio, no clip (verl's
    ``reinforce`` loss of bypass mode, whose gradient ``-w A grad log pi`` it shares)."""
    return Surrogate(-advantages * logprobs * weight, _none(mask), _none(mask))
