"""verl's off-policy diagnostics against a hand-worked example.

x = log(pi_train / pi_rollout) per token; the expected numbers are in the comments.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.algorithms.off_policy import (
    SEQUENCE_MEAN_KEYS,
    TOKEN_MEAN_KEYS,
    off_policy_metrics,
)
from tests.helpers.tensors import close

torch.set_num_threads(1)
NAN = float("nan")
LOG2 = math.log(2.0)


def _example():
    """Row 0: rollout log-probs -1, -1, train -1 + log 2, -1 (x = log 2, 0; rho 2, 1).
    Row 1: rollout -2, train -2 - log 2 (x = -log 2, rho 0.5), then a masked NaN."""
    training = torch.tensor([[-1.0 + LOG2, -1.0], [-2.0 - LOG2, NAN]])
    rollout = torch.tensor([[-1.0, -1.0], [-2.0, NAN]])
    mask = torch.tensor([[1, 1], [1, 0]])
    return training, rollout, mask


def test_the_hand_worked_example():
    metrics = off_policy_metrics(*_example(), cap=1.5)
    close(metrics["offpolicy_kl_k1"], 0.0)  # (-log 2 + 0 + log 2) / 3
    # rho - 1 - x: (1 - log 2) + 0 + (-0.5 + log 2) = 0.5, over 3 tokens
    close(metrics["offpolicy_kl_k3"], 0.5 / 3)
    close(metrics["offpolicy_chi2_token"], (4 + 1 + 0.25) / 3 - 1)  # 0.75
    close(metrics["offpolicy_chi2_seq"], ((4 - 1) + (0.25 - 1)) / 2)  # products 2, 0.5
    close(metrics["offpolicy_ratio_frac_high"], 1 / 3)  # 2 > 1.5
    close(metrics["offpolicy_ratio_frac_low"], 1 / 3)  # 0.5 < 1 / 1.5
    # ESS of w = rho clamped to [2/3, 1.5]: 1.5, 1, 2/3
    weights = [1.5, 1.0, 2 / 3]
    close(metrics["offpolicy_ess"], sum(weights) ** 2 / (3 * sum(w * w for w in weights)))
    # mean log-prob per sequence: train -1 + log2 / 2, -2 - log 2; rollout -1, -2
    close(metrics["offpolicy_training_ppl"], (math.e / math.sqrt(2) + 2 * math.e**2) / 2)
    close(metrics["offpolicy_training_log_ppl"], (1 - LOG2 / 2 + 2 + LOG2) / 2)
    close(metrics["offpolicy_rollout_ppl"], (math.e + math.e**2) / 2)
    close(metrics["offpolicy_rollout_log_ppl"], 1.5)
    # rollout mean - train mean per sequence: -log2 / 2, log 2
    close(metrics["offpolicy_log_ppl_diff"], (-LOG2 / 2 + LOG2) / 2)
    close(metrics["offpolicy_log_ppl_abs_diff"], (LOG2 / 2 + LOG2) / 2)
    close(metrics["offpolicy_ppl_ratio"], (2**-0.5 + 2.0) / 2)


def test_every_key_is_prefixed_and_documented_as_a_token_or_sequence_mean():
    metrics = off_policy_metrics(*_example(), cap=2.0)
    assert set(metrics) == set(TOKEN_MEAN_KEYS) | set(SEQUENCE_MEAN_KEYS)
    assert not set(TOKEN_MEAN_KEYS) & set(SEQUENCE_MEAN_KEYS)
    assert all(key.startswith("offpolicy_") for key in metrics)
    assert all(value.dim() == 0 for value in metrics.values())


def test_equal_weights_have_an_effective_sample_size_of_one():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]])
    metrics = off_policy_metrics(rollout + 0.3, rollout, torch.ones(2, 3), cap=2.0)
    close(metrics["offpolicy_ess"], 1.0)
    close(metrics["offpolicy_chi2_token"], math.exp(0.6) - 1)


def test_on_policy_everything_is_neutral():
    training, _, mask = _example()
    metrics = off_policy_metrics(training, training.clone(), mask, cap=2.0)
    for key in ("kl_k1", "kl_k3", "chi2_token", "chi2_seq", "log_ppl_diff", "ratio_frac_high"):
        close(metrics[f"offpolicy_{key}"], 0.0)
    close(metrics["offpolicy_ess"], 1.0)
    close(metrics["offpolicy_ppl_ratio"], 1.0)


def test_masked_positions_change_nothing():
    training, rollout, mask = _example()
    with_nan = off_policy_metrics(training, rollout, mask, cap=1.5)
    finite = off_policy_metrics(
        torch.nan_to_num(training, nan=-50.0), torch.nan_to_num(rollout, nan=3.0), mask, cap=1.5
    )
    for key, value in with_nan.items():
        assert torch.equal(value, finite[key]), key


def test_an_empty_mask_reports_finite_zeros():
    training, rollout, _ = _example()
    metrics = off_policy_metrics(training, rollout, torch.zeros(2, 2), cap=2.0)
    assert all(value.item() == 0.0 for value in metrics.values())


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_extreme_ratios_stay_finite(sign):
    rollout = torch.tensor([[-1.0, -1.0]])
    training = rollout + sign * torch.tensor([[30.0, 30.0]])
    metrics = off_policy_metrics(training, rollout, torch.ones(1, 2), cap=2.0)
    assert all(torch.isfinite(value) for value in metrics.values())


def test_the_metrics_carry_no_gradient():
    training, rollout, mask = _example()
    training = torch.nan_to_num(training).requires_grad_(True)
    metrics = off_policy_metrics(training, rollout, mask, cap=2.0)
    assert not any(value.requires_grad for value in metrics.values())
