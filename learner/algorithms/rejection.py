"""Rejection sampling and M2PO: which tokens of the batch to drop from the loss (and its
normalizer) because the behavior policy drifted too far from the proximal one.

Both return a ``keep`` mask [B, T] that the learner ANDs into the loss mask, computed on
the whole batch before the first update (the proximal pre-pass), and detached stats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT, masked_mean

Tensor = torch.Tensor


class RejectionRule(Protocol):
    """Anything with these attributes: :class:`Criterion`, or the config's
    ``RejectionCriterion``."""

    @property
    def statistic(self) -> str: ...  # token | seq_sum | seq_mean | seq_max
    @property
    def estimator(self) -> str: ...  # ratio | k1 | k2 | k3
    @property
    def low(self) -> float | None: ...
    @property
    def high(self) -> float | None: ...


@dataclass(frozen=True)
class Criterion:
    """One criterion, for callers without a config: keep while low <= statistic <= high."""

    statistic: str
    estimator: str = "ratio"
    low: float | None = None
    high: float | None = None


# Per token, from x = log(pi_prox / pi_b) clamped to +-20. The k's estimate
# KL(pi_b || pi_prox), whose samples we have (verl's rollout_rs): k1 = log(pi_b / pi_prox),
# k2 = x^2 / 2, k3 = rho - 1 - log rho (non-negative, unbiased).
ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "ratio": torch.exp,
    "k1": torch.neg,
    "k2": lambda x: 0.5 * x.square(),
    "k3": lambda x: torch.expm1(x) - x,
}

STATISTICS = ("token", "seq_sum", "seq_mean", "seq_max")


def _statistic(per_token: Tensor, mask: Tensor, statistic: str) -> Tensor:
    """The statistic at each token [B, T]: its own value, or its sequence's sum, mean or max
    over the valid tokens (0 for a row with none)."""
    zeros = torch.zeros_like(per_token)
    if statistic == "token":
        return per_token
    if statistic == "seq_sum":
        per_sequence = torch.where(mask, per_token, zeros).sum(-1)
    elif statistic == "seq_mean":
        lengths = mask.sum(-1).clamp(min=1).to(per_token.dtype)
        per_sequence = torch.where(mask, per_token, zeros).sum(-1) / lengths
    elif statistic == "seq_max":
        masked = torch.where(mask, per_token, torch.full_like(per_token, -torch.inf))
        per_sequence = torch.where(mask.any(-1), masked.amax(-1), zeros[:, 0])
    else:
        raise ValueError(
            f"unknown rejection statistic {statistic!r}; expected one of: {', '.join(STATISTICS)}"
        )
    return per_sequence.unsqueeze(-1).expand_as(per_token)


def _sequence_frac(rejected: Tensor, mask: Tensor) -> Tensor:
    """Fraction of the sequences with a valid token that have a rejected valid token."""
    return masked_mean((rejected & mask).any(-1).float(), mask.any(-1))


def rejection_keep(
    proximal_logprobs: Tensor,
    behavior_logprobs: Tensor,
    mask: Tensor,
    criteria: Sequence[RejectionRule],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Tokens that pass every criterion.  -> (keep [B, T] bool, stats)

    Per valid token ``x = log(pi_prox / pi_b)``, clamped to +-20, then the criterion's
    estimator (:data:`ESTIMATORS`) and statistic (the token's own value, or its sequence's
    sum, mean or max over the valid tokens); the token, or for a sequence statistic the
    whole row, is rejected where the statistic is below ``low`` or above ``high``. A token
    is kept only if every criterion keeps it, and only where ``mask`` is set.

    Stats (fractions of the valid tokens, or of the sequences with one):
    ``rejection_token_frac``, ``rejection_seq_frac`` (a sequence with any token rejected),
    and per criterion ``i`` what it alone rejects: ``rejection_{i}_{statistic}_{estimator}``
    + ``_token_frac`` and ``_seq_frac``.
    """
    mask = mask.bool()
    log_rho = (proximal_logprobs.float() - behavior_logprobs.float()).detach()
    log_rho = torch.where(mask, log_rho, torch.zeros_like(log_rho))
    log_rho = log_rho.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    keep = mask.clone()
    stats: dict[str, Tensor] = {}
    with torch.no_grad():
        for index, criterion in enumerate(criteria):
            if criterion.estimator not in ESTIMATORS:
                raise ValueError(
                    f"unknown rejection estimator {criterion.estimator!r}; "
                    f"expected one of: {', '.join(ESTIMATORS)}"
                )
            value = _statistic(ESTIMATORS[criterion.estimator](log_rho), mask, criterion.statistic)
            rejected = torch.zeros_like(mask)
            if criterion.low is not None:
                rejected |= value < criterion.low
            if criterion.high is not None:
                rejected |= value > criterion.high
            keep &= ~rejected
            name = f"rejection_{index}_{criterion.statistic}_{criterion.estimator}"
            stats[f"{name}_token_frac"] = masked_mean(rejected.float(), mask)
            stats[f"{name}_seq_frac"] = _sequence_frac(rejected, mask)
        dropped = mask & ~keep
        stats["rejection_token_frac"] = masked_mean(dropped.float(), mask)
        stats["rejection_seq_frac"] = _sequence_frac(dropped, mask)
    return keep, stats


def m2po_keep(
    proximal_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, threshold: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """M2PO's second-moment mask over the valid tokens given.  -> (keep [B, T] bool, stats)

    With ``m2 = (log(pi_prox / pi_b))^2`` per valid token, drop the tokens with the largest
    ``m2`` (greedily, by magnitude) until the mean ``m2`` of the kept ones is at most
    ``threshold`` (Zheng et al. 2025, "Prosperity before Collapse"; as AReaL's
    ``m2_threshold``). If even the smallest ``m2`` is above it, that one token is kept, as
    AReaL does. Stats: ``m2po_masked_frac`` (of the valid tokens),
    ``m2po_second_moment_before`` and ``m2po_second_moment_after`` (mean m2 of the kept).
    """
    if threshold <= 0:
        raise ValueError(f"m2po threshold must be > 0, got {threshold}")
    mask = mask.bool()
    with torch.no_grad():
        log_rho = proximal_logprobs.float().detach() - behavior_logprobs.float().detach()
        m2 = torch.where(mask, log_rho, torch.zeros_like(log_rho)).square()
        values = m2[mask].double()
        count = values.numel()
        keep_valid = torch.ones(count, dtype=torch.bool, device=mask.device)
        if count:
            ordered, order = torch.sort(values, descending=True, stable=True)
            rest_sums = ordered.flip(0).cumsum(0).flip(0)  # sum of ordered[i:]
            rest_counts = torch.arange(count, 0, -1, device=values.device, dtype=values.dtype)
            fits = torch.nonzero(rest_sums / rest_counts <= threshold)
            dropped = int(fits[0, 0]) if len(fits) else count - 1
            keep_valid[order[:dropped]] = False
        keep = torch.zeros_like(mask)
        keep[mask] = keep_valid
        stats = {
            "m2po_masked_frac": masked_mean((mask & ~keep).float(), mask),
            "m2po_second_moment_before": masked_mean(m2, mask),
            "m2po_second_moment_after": masked_mean(m2, keep),
        }
    return keep, stats
