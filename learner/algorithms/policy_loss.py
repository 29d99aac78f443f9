"""The policy loss: a surrogate (:mod:`.surrogates`, by ``algorithm.policy_loss``) with a
behavior correction (:mod:`.corrections`), aggregated (:mod:`.aggregation`). Notation:
see the package docstring."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.aggregation import aggregate
from asyncrl.learner.algorithms.corrections import behavior_weights
from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT, masked_mean
from asyncrl.learner.algorithms.registry import POLICY_LOSSES, PolicyLoss
from asyncrl.learner.algorithms.surrogates import Surrogate

Tensor = torch.Tensor


def policy_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss: str = "ppo",
    correction: str = "tis",
    correction_level: str = "token",
    correction_cap: float = 2.0,
    correction_floor: float | None = None,
    weight_scale: float | Tensor = 1.0,
    aggregation: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    norm_length: int | None = None,
    **knobs: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The ``loss`` surrogate with a behavior correction.  -> (loss, stats)

    logprobs [B, T] (with grad: pi_theta), proximal_logprobs [B, T] (pi_prox),
    behavior_logprobs [B, T] (pi_b, as the generator recorded them),
    advantages [B, T] ([B] is broadcast), mask [B, T].

    The generator's tokens come from pi_b, which may be several versions old (and is
    numerically a different engine), so the loss weights each token by ``w =
    correction(pi_prox / pi_b) / weight_scale`` (detached; :func:`behavior_weights`
    reads the ``correction*`` knobs); ``weight_scale`` is the batch's mean w, or 1.

    ``loss`` picks the surrogate (:data:`~.registry.POLICY_LOSSES`, :mod:`.surrogates`);
    ``knobs`` are surrogate knobs by their ``algorithm`` keys (``clip_low``, ``clip_high``,
    ``clip_c``, ``sapo_tau_pos``, ``sapo_tau_neg``; :meth:`~.registry.PolicyLoss.knobs_of`
    reads a loss's own from the section): each surrogate takes its own and ignores the
    rest, except ``clip_c``, an error where it does not apply. :func:`aggregate` applies
    ``aggregation`` with the global normalizers to every surrogate (verl forces
    seq-mean-token-mean for gspo and sapo, a per-sequence mean for gmpo: match it).

    Stats (detached, over this call's valid tokens): ``clip_frac`` (the clip removed the
    gradient; cispo: truncated the weight; 0 for sapo and reinforce), ``dual_clip_frac``,
    ``ppo_kl`` (k3 estimate of KL(pi_prox || pi_theta)), and :func:`behavior_weights`'
    ``importance_*`` (rho before correction at the chosen level; ``importance_applied_mean``
    after ``weight_scale``).
    """
    surrogate = POLICY_LOSSES[loss]
    own = _own_knobs(surrogate, knobs)
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = torch.where(mask, advantages.float().detach().expand_as(zeros), zeros)
    log_ratio = torch.where(mask, logprobs.float() - proximal_logprobs.float().detach(), zeros)

    weight, correction_stats = _scaled_behavior_weights(
        proximal_logprobs,
        behavior_logprobs,
        mask,
        weight_scale,
        correction=correction,
        level=correction_level,
        cap=correction_cap,
        floor=correction_floor,
    )
    result = surrogate.fn(
        logprobs=torch.where(mask, logprobs.float(), zeros),
        log_ratio=log_ratio,
        advantages=advantages,
        mask=mask,
        weight=weight,
        **own,
    )
    value = aggregate(
        result.losses,
        mask,
        aggregation,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        norm_length=norm_length,
    )
    return value, _stats(result, log_ratio, mask) | correction_stats


def _scaled_behavior_weights(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    weight_scale: float | Tensor,
    **correction: str | float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`behavior_weights` divided by the batch's ``weight_scale``, and their stats."""
    weight, stats = behavior_weights(proximal_logprobs, behavior_logprobs, mask, **correction)
    if isinstance(weight_scale, Tensor) or weight_scale != 1.0:
        weight = weight / weight_scale
        stats["importance_applied_mean"] = masked_mean(weight, mask)
    return weight, stats


def _own_knobs(surrogate: PolicyLoss, knobs: dict[str, float | None]) -> dict[str, float | None]:
    """The knobs ``surrogate`` reads; an unknown knob, or a dual clip it has none of, is an
    error."""
    known = {knob for entry in POLICY_LOSSES.values() for knob in entry.knobs}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise TypeError(f"policy_loss got unknown knobs: {', '.join(unknown)}")
    if knobs.get("clip_c") is not None and "clip_c" not in surrogate.knobs:
        users = ", ".join(name for name, entry in POLICY_LOSSES.items() if "clip_c" in entry.knobs)
        raise ValueError(
            f"clip_c (the dual clip) is only used by policy_loss: {users}, not {surrogate.name}"
        )
    return {knob: value for knob, value in knobs.items() if knob in surrogate.knobs}


@torch.no_grad()
def _stats(result: Surrogate, log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Where the clips acted, and the k3 estimate of KL(pi_prox || pi_theta)."""
    lr = log_ratio.detach()
    return {
        "clip_frac": masked_mean(result.clipped.float(), mask),
        "dual_clip_frac": masked_mean(result.dual_clipped.float(), mask),
        "ppo_kl": masked_mean(torch.expm1(lr.clamp(max=LOG_RATIO_LIMIT)) - lr, mask),
    }
