"""Rejection sampling and M2PO masks against hand-worked examples.

x = log(pi_prox / pi_b) per token; expected masks and fractions are worked out by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config.algorithm import RejectionCriterion
from asyncrl.learner.algorithms.rejection import Criterion, m2po_keep, rejection_keep
from tests.helpers.tensors import close

torch.set_num_threads(1)
NAN = float("nan")


def _batch(log_rho: list[list[float]], mask: list[list[int]]):
    """(proximal, behavior, mask) with log(pi_prox / pi_b) = log_rho; NaN where masked."""
    log_rho_t = torch.tensor(log_rho, dtype=torch.float64)
    mask_t = torch.tensor(mask).bool()
    proximal = torch.full(log_rho_t.shape, -1.0, dtype=torch.float64)
    behavior = torch.where(mask_t, proximal - log_rho_t, torch.full_like(proximal, NAN))
    return proximal.float(), behavior.float(), mask_t


# row 0: x = log 0.45, 0, 0 -> the ratio 0.45 is below 0.5 (token criterion rejects it);
#        sum of k1 = -x: 0.799, within the sequence criterion (low -1)
# row 1: x = 0.5, 0.5, (masked) -> ratios 1.65; sum of k1 = -1.0, exactly the bound: kept
# row 2: x = 0.6, 0.6, 0.6 -> ratios 1.82, kept per token; sum of k1 = -1.8 < -1: row rejected
ANDED_LOG_RHO = [[math.log(0.45), 0.0, 0.0], [0.5, 0.5, 0.0], [0.6, 0.6, 0.6]]
ANDED_MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("make", [Criterion, RejectionCriterion])
def test_two_criteria_are_anded(make):
    proximal, behavior, mask = _batch(ANDED_LOG_RHO, ANDED_MASK)
    criteria = [
        make(statistic="token", estimator="ratio", low=0.5, high=2.0),
        make(statistic="seq_sum", estimator="k1", low=-1.0),
    ]
    keep, stats = rejection_keep(proximal, behavior, mask, criteria)
    assert keep.tolist() == [[False, True, True], [True, True, False], [False, False, False]]
    # 8 valid tokens, 1 + 3 dropped; rows 0 and 2 of 3 have a drop
    close(stats["rejection_token_frac"], 4 / 8, atol=1e-6)
    close(stats["rejection_seq_frac"], 2 / 3, atol=1e-6)
    close(stats["rejection_0_token_ratio_token_frac"], 1 / 8, atol=1e-6)
    close(stats["rejection_0_token_ratio_seq_frac"], 1 / 3, atol=1e-6)
    close(stats["rejection_1_seq_sum_k1_token_frac"], 3 / 8, atol=1e-6)
    close(stats["rejection_1_seq_sum_k1_seq_frac"], 1 / 3, atol=1e-6)


def test_no_criteria_keeps_the_mask():
    proximal, behavior, mask = _batch(ANDED_LOG_RHO, ANDED_MASK)
    keep, stats = rejection_keep(proximal, behavior, mask, [])
    assert torch.equal(keep, mask)
    assert stats["rejection_token_frac"].item() == 0.0


@pytest.mark.parametrize(
    ("estimator", "value"),
    [
        # one token with x = log 2 (verl's estimators of KL(pi_b || pi_prox))
        ("ratio", 2.0),
        ("k1", -math.log(2.0)),  # log(pi_b / pi_prox) = -0.6931
        ("k2", math.log(2.0) ** 2 / 2),  # 0.2402
        ("k3", 2.0 - 1.0 - math.log(2.0)),  # rho - 1 - log rho = 0.3069
    ],
)
def test_each_estimator_value_per_token(estimator, value):
    proximal, behavior, mask = _batch([[math.log(2.0)]], [[1]])

    def kept(**bounds) -> bool:
        keep, _ = rejection_keep(
            proximal, behavior, mask, [Criterion("token", estimator, **bounds)]
        )
        return bool(keep[0, 0])

    assert kept(high=value + 1e-4) and not kept(high=value - 1e-4)
    assert kept(low=value - 1e-4) and not kept(low=value + 1e-4)


@pytest.mark.parametrize(
    ("statistic", "estimator", "bound", "expected"),
    [
        # row 0: x = 0.4, -0.4 ; row 1: x = 1.0, 0, (masked)
        # k2 = x^2 / 2: row 0 0.08, 0.08 ; row 1 0.5, 0
        ("seq_max", "k2", 0.3, [[True, True, False], [False, False, False]]),  # max 0.5 > 0.3
        ("seq_mean", "k2", 0.3, [[True, True, False], [True, True, False]]),  # means 0.08, 0.25
        ("seq_sum", "k2", 0.2, [[True, True, False], [False, False, False]]),  # sums 0.16, 0.5
        ("token", "k2", 0.2, [[True, True, False], [False, True, False]]),
    ],
)
def test_sequence_statistics_reject_whole_rows(statistic, estimator, bound, expected):
    proximal, behavior, mask = _batch([[0.4, -0.4, 0.0], [1.0, 0.0, 0.0]], [[1, 1, 0], [1, 1, 0]])
    keep, _ = rejection_keep(
        proximal, behavior, mask, [Criterion(statistic, estimator, high=bound)]
    )
    assert keep.tolist() == expected


def test_the_log_ratio_is_clamped_to_20():
    # x = 50 counts as 20: k2 = 200, not 1250
    proximal, behavior, mask = _batch([[50.0]], [[1]])
    keep, _ = rejection_keep(proximal, behavior, mask, [Criterion("token", "k2", high=200.5)])
    assert keep.tolist() == [[True]]


def test_masked_positions_change_nothing():
    proximal, behavior, mask = _batch(ANDED_LOG_RHO, ANDED_MASK)
    finite = torch.where(mask, behavior, torch.full_like(behavior, 30.0))
    criteria = [Criterion("seq_max", "k3", high=0.5), Criterion("seq_mean", "ratio", low=0.9)]
    keep_nan, stats_nan = rejection_keep(proximal, behavior, mask, criteria)
    keep, stats = rejection_keep(proximal, finite, mask, criteria)
    assert torch.equal(keep_nan, keep)
    assert not keep[~mask].any()
    for key, value in stats.items():
        assert torch.equal(stats_nan[key], value), key


def test_an_unknown_estimator_or_statistic_is_an_error():
    proximal, behavior, mask = _batch([[0.0]], [[1]])
    with pytest.raises(ValueError, match="estimator"):
        rejection_keep(proximal, behavior, mask, [Criterion("token", "k9", high=1.0)])
    with pytest.raises(ValueError, match="statistic"):
        rejection_keep(proximal, behavior, mask, [Criterion("seq_median", "k1", high=1.0)])


# --------------------------------------------------------------------- M2PO

# valid x = 0.25, -1, 0.5, 0, -0.25 (then a masked NaN): m2 = x^2 = 1/16, 1, 1/4, 0, 1/16
# mean 1.375 / 5 = 0.275. Drop 1 -> (1/16 + 1/4 + 0 + 1/16) / 4 = 0.09375;
# drop 1/4 too -> (1/16 + 0 + 1/16) / 3 = 0.041667.
M2_LOG_RHO = [[0.25, -1.0, 0.5, 0.0, -0.25, 0.0]]
M2_MASK = [[1, 1, 1, 1, 1, 0]]


@pytest.mark.parametrize(
    ("threshold", "expected_keep", "after"),
    [
        (1.0, [True, True, True, True, True, False], 0.275),  # already below: nothing dropped
        (0.1, [True, False, True, True, True, False], 0.09375),
        (0.09375, [True, False, True, True, True, False], 0.09375),  # at most: equal is fine
        (0.09, [True, False, False, True, True, False], 0.125 / 3),
    ],
)
def test_m2po_drops_the_largest_squared_log_ratios_until_the_mean_fits(
    threshold, expected_keep, after
):
    proximal, behavior, mask = _batch(M2_LOG_RHO, M2_MASK)
    keep, stats = m2po_keep(proximal, behavior, mask, threshold)
    assert keep.tolist() == [expected_keep]
    dropped = 5 - sum(expected_keep)
    close(stats["m2po_masked_frac"], dropped / 5, atol=1e-6)
    close(stats["m2po_second_moment_before"], 0.275, atol=1e-6)
    close(stats["m2po_second_moment_after"], after, atol=1e-6)


def test_m2po_ranks_tokens_across_the_whole_batch():
    # the same tokens split over two rows give the same mask
    log_rho = [[0.25, -1.0, 0.5], [0.0, -0.25, 0.0]]
    proximal, behavior, mask = _batch(log_rho, [[1, 1, 1], [1, 1, 0]])
    keep, _ = m2po_keep(proximal, behavior, mask, 0.09)
    assert keep.tolist() == [[True, False, False], [True, True, False]]


def test_m2po_keeps_the_smallest_token_when_nothing_fits():
    # m2 = 1, 4: even 1 alone is above 0.5; AReaL keeps the smallest rather than none
    proximal, behavior, mask = _batch([[1.0, -2.0]], [[1, 1]])
    keep, stats = m2po_keep(proximal, behavior, mask, 0.5)
    assert keep.tolist() == [[True, False]]
    close(stats["m2po_second_moment_after"], 1.0, atol=1e-6)


def test_m2po_on_an_empty_mask_keeps_nothing_and_reports_zeros():
    proximal, behavior, mask = _batch([[1.0, -2.0]], [[0, 0]])
    keep, stats = m2po_keep(proximal, behavior, mask, 0.04)
    assert not keep.any()
    assert all(value.item() == 0.0 for value in stats.values())


def test_m2po_masked_positions_change_nothing():
    proximal, behavior, mask = _batch(M2_LOG_RHO, M2_MASK)
    finite = torch.where(mask, behavior, torch.full_like(behavior, 40.0))
    keep_nan, stats_nan = m2po_keep(proximal, behavior, mask, 0.09)
    keep, stats = m2po_keep(proximal, finite, mask, 0.09)
    assert torch.equal(keep_nan, keep)
    for key, value in stats.items():
        assert torch.equal(stats_nan[key], value), key
