"""How far the generator's policy is from the learner's: the diagnostics verl logs under
``rollout_corr/`` (``compute_offpolicy_metrics`` and its IS-weight metrics), so that runs
can be compared with verl's key for key."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.masked import LOG_RATIO_LIMIT, masked_mean

Tensor = torch.Tensor

TOKEN_MEAN_KEYS = (
    "offpolicy_kl_k1",
    "offpolicy_kl_k3",
    "offpolicy_chi2_token",
    "offpolicy_ratio_frac_high",
    "offpolicy_ratio_frac_low",
    "offpolicy_ess",
)
"""Means over the valid tokens (the ESS is a ratio: its micro-batch mean approximates)."""

SEQUENCE_MEAN_KEYS = (
    "offpolicy_training_ppl",
    "offpolicy_training_log_ppl",
    "offpolicy_rollout_ppl",
    "offpolicy_rollout_log_ppl",
    "offpolicy_log_ppl_diff",
    "offpolicy_log_ppl_abs_diff",
    "offpolicy_ppl_ratio",
    "offpolicy_chi2_seq",
)
"""Means over the sequences with a valid token."""


def off_policy_metrics(
    training_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cap: float
) -> dict[str, Tensor]:
    """Off-policy diagnostics of one batch, detached.  -> {key: scalar tensor}

    With ``x = log(pi_train / pi_rollout)`` per valid token, ``rho = exp(x)`` (x clamped
    to +-20 first), ``C = cap``:

    - ``offpolicy_kl_k1`` = mean(-x), ``offpolicy_kl_k3`` = mean(rho - 1 - x): KL(rollout
      || training), estimated on the rollout's samples;
    - ``offpolicy_{training,rollout}_ppl`` = mean over sequences of exp(-mean_t log pi),
      ``..._log_ppl`` the same without exp; ``offpolicy_log_ppl_diff`` = mean over sequences
      of (mean_t log pi_rollout - mean_t log pi_train), ``..._abs_diff`` of its size,
      ``offpolicy_ppl_ratio`` of its exp;
    - ``offpolicy_chi2_token`` = mean(rho^2) - 1; ``offpolicy_chi2_seq`` = mean over
      sequences of exp(2 sum_t x) - 1 (the product ratio, its log sum clamped to +-20);
    - ``offpolicy_ess`` = (sum w)^2 / (n sum w^2) in (0, 1], w = rho clamped to [1/C, C];
    - ``offpolicy_ratio_frac_high`` / ``_low``: fraction of tokens with rho > C / < 1/C.

    :data:`TOKEN_MEAN_KEYS` are means over the valid tokens, :data:`SEQUENCE_MEAN_KEYS`
    over the sequences with one. Nothing valid: every key is 0.
    """
    mask = mask.bool()
    with torch.no_grad():
        zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        training = torch.where(mask, training_logprobs.detach().float(), zeros)
        rollout = torch.where(mask, rollout_logprobs.detach().float(), zeros)
        raw_log_ratio = training - rollout
        log_ratio = raw_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        rho = log_ratio.exp()

        lengths = mask.sum(-1)
        sequences = lengths > 0
        per_sequence_length = lengths.clamp(min=1).float()
        training_mean = training.sum(-1) / per_sequence_length  # [B]
        rollout_mean = rollout.sum(-1) / per_sequence_length
        log_ppl_diff = rollout_mean - training_mean
        log_sequence_ratio = raw_log_ratio.sum(-1).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)

        def per_sequence(values: Tensor) -> Tensor:
            return masked_mean(values, sequences)

        ess_weights = torch.where(mask, rho.clamp(1.0 / cap, cap), zeros)
        ess_count = mask.sum().clamp(min=1).float()
        ess = ess_weights.sum().square() / (ess_count * ess_weights.square().sum()).clamp(min=1e-30)
        return {
            "offpolicy_kl_k1": masked_mean(-raw_log_ratio, mask),
            "offpolicy_kl_k3": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "offpolicy_chi2_token": masked_mean(rho.square() - 1.0, mask),
            "offpolicy_ratio_frac_high": masked_mean((rho > cap).float(), mask),
            "offpolicy_ratio_frac_low": masked_mean((rho < 1.0 / cap).float(), mask),
            "offpolicy_ess": ess,
            "offpolicy_training_ppl": per_sequence((-training_mean).exp()),
            "offpolicy_training_log_ppl": per_sequence(-training_mean),
            "offpolicy_rollout_ppl": per_sequence((-rollout_mean).exp()),
            "offpolicy_rollout_log_ppl": per_sequence(-rollout_mean),
            "offpolicy_log_ppl_diff": per_sequence(log_ppl_diff),
            "offpolicy_log_ppl_abs_diff": per_sequence(log_ppl_diff.abs()),
            "offpolicy_ppl_ratio": per_sequence(log_ppl_diff.exp()),
            "offpolicy_chi2_seq": per_sequence(torch.expm1(2.0 * log_sequence_ratio)),
        }
