"""KL to a frozen reference model: per-token estimators (Schulman, "Approximating KL
divergence"), registered in :data:`~.registry.KL_ESTIMATORS`."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT
from asyncrl.learner.algorithms.registry import KL_ESTIMATORS, register_kl_estimator

Tensor = torch.Tensor


@register_kl_estimator("k1", unbiased=True, non_negative=False)
def k1(log_ratio: Tensor) -> Tensor:
    """``x``: unbiased, can be negative."""
    return log_ratio


@register_kl_estimator("k2", unbiased=False, non_negative=True)
def k2(log_ratio: Tensor) -> Tensor:
    """``x^2 / 2``: low variance, biased."""
    return 0.5 * log_ratio.square()


@register_kl_estimator("k3", unbiased=True, non_negative=True)
def k3(log_ratio: Tensor) -> Tensor:
    """``exp(-x) - 1 + x``: unbiased and never negative; ``x`` clamped to +-20 inside ``exp``."""
    return (-log_ratio).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp() - 1.0 + log_ratio


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.  [B, T]

    With ``x = logprobs - ref_logprobs``: ``k1 = x`` (unbiased, can be negative),
    ``k2 = x^2 / 2`` (low variance, biased), ``k3 = exp(-x) - 1 + x`` (unbiased, never
    negative). Differentiable in ``logprobs``: in the loss add
    ``kl_coef * aggregate(kl, mask, ...)``; in the reward pass it detached to
    :func:`~.advantages.token_level_rewards`.
    """
    chosen = KL_ESTIMATORS[estimator]
    return chosen.fn(logprobs.float() - ref_logprobs.float().detach())
