"""KL to a frozen reference model: per-token estimators (Schulman, "Approximating KL
divergence"), registered in :data:`~.registry.KL_ESTIMATORS`."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT
from asyncrl.learner.algorithms.registry import KL_ESTIMATORS, register_kl_estimator

Tensor = torch.Tensor

K3_LIMIT = 10.0
"""k3 is capped at 10 per token (as verl's ``low_var_kl``): its gradient grows like
``exp(-x)``, and past the cap a token far below the reference adds no gradient at all."""


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
    """``exp(-x) - 1 + x`` with ``x`` clamped to +-20 (in both terms), capped at 10.

    verl's ``low_var_kl``. The clamp is applied once, so past it the estimate is flat
    and has no gradient, instead of the linear term alone pushing ``x`` further out.
    Unbiased and never negative inside the clamps.
    """
    x = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return (torch.exp(-x) - 1.0 + x).clamp(max=K3_LIMIT)


@register_kl_estimator("abs", unbiased=False, non_negative=True)
def absolute(log_ratio: Tensor) -> Tensor:
    """``|x|``: never negative, biased (verl's ``abs``)."""
    return log_ratio.abs()


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs.  [B, T]

    With ``x = logprobs - ref_logprobs``: ``k1 = x`` (unbiased, can be negative),
    ``k2 = x^2 / 2`` (low variance, biased), ``k3 = exp(-x) - 1 + x`` (unbiased, never
    negative; ``x`` clamped to +-20, the value capped at 10, as verl), ``abs = |x|``.
    Differentiable in ``logprobs``: in the loss add ``kl_coef * aggregate(kl, mask, ...)``;
    in the reward pass it detached to :func:`~.advantages.token_level_rewards`.
    """
    chosen = KL_ESTIMATORS[estimator]
    return chosen.fn(logprobs.float() - ref_logprobs.float().detach())
