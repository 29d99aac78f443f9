"""Behavior corrections against hand-worked examples: the levels (token, the sequence's
product, its geometric mean), IcePop's two-sided mask, and the batch normalisation scale.

Expected numbers are worked out by hand in the comments.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch

from asyncrl.config import AlgorithmConfig
from asyncrl.learner.algorithms.corrections import LEVELS, batch_weight_scale, behavior_weights
from asyncrl.learner.algorithms.registry import CORRECTIONS
from tests.helpers.tensors import close

torch.set_num_threads(1)
NAN = float("nan")


def _ratios(log_rho: list[list[float]], mask: list[list[int]]):
    """(proximal, behavior, mask) with log(pi_prox / pi_b) = log_rho; NaN behavior where masked."""
    log_rho_t = torch.tensor(log_rho)
    mask_t = torch.tensor(mask).bool()
    proximal = torch.full(log_rho_t.shape, -1.0)
    behavior = torch.where(mask_t, proximal - log_rho_t, torch.full_like(proximal, NAN))
    return proximal, behavior, mask_t


def test_the_names_match_the_config():
    fields = AlgorithmConfig.model_fields
    assert set(CORRECTIONS) == set(typing.get_args(fields["correction"].annotation))
    assert set(LEVELS) == set(typing.get_args(fields["correction_level"].annotation))
    assert CORRECTIONS["icepop"].uses_cap and CORRECTIONS["icepop"].uses_floor
    assert not any(entry.uses_floor for name, entry in CORRECTIONS.items() if name != "icepop")


@pytest.mark.parametrize(
    ("correction", "expected"),
    [
        # rho = 0.25, 0.5, 1, 2, 3 with C = 2 (floor 1 / C = 0.5, both bounds inclusive)
        ("none", [1, 1, 1, 1, 1]),
        ("tis", [0.25, 0.5, 1, 2, 2]),
        ("mis", [0.25, 0.5, 1, 2, 0]),
        ("icepop", [0, 0.5, 1, 2, 0]),
        ("decoupled", [0.25, 0.5, 1, 2, 3]),
    ],
)
def test_token_level_weights_follow_each_rule(correction, expected):
    log_rho = [[math.log(r) for r in (0.25, 0.5, 1.0, 2.0, 3.0)]]
    proximal, behavior, mask = _ratios(log_rho, [[1, 1, 1, 1, 1]])
    weight, stats = behavior_weights(proximal, behavior, mask, correction=correction, cap=2.0)
    close(weight, [expected])
    close(stats["importance_weight_mean"], 6.75 / 5)  # (0.25 + 0.5 + 1 + 2 + 3) / 5
    close(stats["importance_truncated_frac"], 1 / 5)  # rho = 3 > 2
    close(stats["importance_below_floor_frac"], 1 / 5)  # rho = 0.25 < 0.5
    close(stats["importance_applied_mean"], sum(expected) / 5)


def test_icepop_floor_can_be_set_below_the_default():
    log_rho = [[math.log(r) for r in (0.1, 0.25, 3.0)]]
    proximal, behavior, mask = _ratios(log_rho, [[1, 1, 1]])
    weight, stats = behavior_weights(
        proximal, behavior, mask, correction="icepop", cap=4.0, floor=0.2
    )
    close(weight, [[0.0, 0.25, 3.0]])  # 0.1 < 0.2 masked; 0.25 (below 1/C) and 3 kept
    close(stats["importance_below_floor_frac"], 1 / 3)


def test_a_floor_not_below_the_cap_is_an_error_for_icepop_only():
    proximal, behavior, mask = _ratios([[0.0]], [[1]])
    with pytest.raises(ValueError, match="floor"):
        behavior_weights(proximal, behavior, mask, correction="icepop", cap=2.0, floor=2.0)
    with pytest.raises(ValueError, match="floor"):  # the default floor 1 / 0.5 = 2
        behavior_weights(proximal, behavior, mask, correction="icepop", cap=0.5)
    weight, _ = behavior_weights(proximal, behavior, mask, correction="tis", cap=0.5)
    close(weight, [[0.5]])  # rho = 1 truncated to C = 0.5


# Row 0: token ratios 2, 2 (third masked); row 1: 0.5, 4 (third masked).
SEQUENCE_LOG_RHO = [[math.log(2.0), math.log(2.0), 0.0], [math.log(0.5), math.log(4.0), 0.0]]
SEQUENCE_MASK = [[1, 1, 0], [1, 1, 0]]


@pytest.mark.parametrize(
    ("level", "correction", "expected"),
    [
        # product: row 0 2 * 2 = 4, row 1 0.5 * 4 = 2
        ("sequence", "decoupled", [[4, 4, 0], [2, 2, 0]]),
        ("sequence", "tis", [[3, 3, 0], [2, 2, 0]]),  # C = 3
        ("sequence", "mis", [[0, 0, 0], [2, 2, 0]]),
        # geometric mean: row 0 sqrt(4) = 2, row 1 sqrt(2)
        ("geometric", "decoupled", [[2, 2, 0], [math.sqrt(2), math.sqrt(2), 0]]),
        ("geometric", "tis", [[2, 2, 0], [math.sqrt(2), math.sqrt(2), 0]]),
        # token: 2, 2 | 0.5, 4 -> mis masks the 4
        ("token", "mis", [[2, 2, 0], [0.5, 0, 0]]),
    ],
)
def test_sequence_level_is_the_product_and_geometric_level_the_mean(level, correction, expected):
    proximal, behavior, mask = _ratios(SEQUENCE_LOG_RHO, SEQUENCE_MASK)
    weight, _ = behavior_weights(
        proximal, behavior, mask, correction=correction, level=level, cap=3.0
    )
    close(torch.where(mask, weight, torch.zeros_like(weight)), expected)


def test_sequence_product_stats_are_per_token_of_the_sequence_ratio():
    proximal, behavior, mask = _ratios(SEQUENCE_LOG_RHO, SEQUENCE_MASK)
    _, stats = behavior_weights(proximal, behavior, mask, level="sequence", cap=3.0)
    close(stats["importance_weight_mean"], 3.0)  # (4 + 4 + 2 + 2) / 4
    close(stats["importance_weight_max"], 4.0)
    close(stats["importance_truncated_frac"], 0.5)  # row 0's two tokens


def test_the_sequence_log_ratio_is_clamped_to_20_after_summing():
    # three tokens of log-ratio 10: product e^30 -> e^20; each token alone stays e^10
    proximal, behavior, mask = _ratios([[10.0, 10.0, 10.0]], [[1, 1, 1]])
    weight, _ = behavior_weights(proximal, behavior, mask, correction="decoupled", level="sequence")
    close(weight / math.exp(20.0), [[1.0, 1.0, 1.0]])
    token, _ = behavior_weights(proximal, behavior, mask, correction="decoupled")
    close(token / math.exp(10.0), [[1.0, 1.0, 1.0]])


@pytest.mark.parametrize("level", LEVELS)
def test_weights_carry_no_gradient(level):
    proximal, behavior, mask = _ratios(SEQUENCE_LOG_RHO, SEQUENCE_MASK)
    proximal = proximal.clone().requires_grad_(True)
    weight, stats = behavior_weights(proximal, behavior, mask, correction="decoupled", level=level)
    assert not weight.requires_grad
    assert not any(value.requires_grad for value in stats.values())


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_what_sits_at_masked_positions_changes_nothing(level, correction):
    proximal, behavior, mask = _ratios(SEQUENCE_LOG_RHO, SEQUENCE_MASK)
    finite = torch.where(mask, behavior, torch.full_like(behavior, -3.0))
    nan_weight, nan_stats = behavior_weights(
        proximal, behavior, mask, correction=correction, level=level
    )
    weight, stats = behavior_weights(proximal, finite, mask, correction=correction, level=level)
    assert torch.equal(nan_weight[mask], weight[mask])
    for key, value in stats.items():
        assert torch.equal(nan_stats[key], value), key


def test_an_unknown_level_names_every_level():
    proximal, behavior, mask = _ratios([[0.0]], [[1]])
    with pytest.raises(ValueError, match="token, sequence, geometric"):
        behavior_weights(proximal, behavior, mask, level="batch")
    with pytest.raises(ValueError, match="token, sequence, geometric"):
        batch_weight_scale(torch.ones(1, 1), mask, "batch")


# ------------------------------------------------------- batch normalisation


def test_token_level_scale_is_the_mean_weight_of_the_valid_tokens():
    weights = torch.tensor([[2.0, 1.0, 7.0], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    scale = batch_weight_scale(weights, mask, "token")
    close(scale, (2 + 1 + 0.5 * 3) / 5)  # the masked 7 is ignored: 0.9
    assert scale.dim() == 0


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_level_scale_counts_each_sequence_once(level):
    # row 0 (2 tokens) weight 3, row 1 (3 tokens) weight 1, row 2 empty (NaN is ignored)
    weights = torch.tensor([[3.0, 3.0, 9.0], [1.0, 1.0, 1.0], [NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    close(batch_weight_scale(weights, mask, level), (3 + 1) / 2)  # tokens would give 9 / 5


def test_scale_is_one_when_every_weight_is_zero():
    weights = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    close(batch_weight_scale(weights, mask, "token"), 1.0)
    close(batch_weight_scale(weights, torch.zeros(2, 2), "sequence"), 1.0)


def test_normalised_weights_average_one():
    proximal, behavior, mask = _ratios(SEQUENCE_LOG_RHO, SEQUENCE_MASK)
    weight, _ = behavior_weights(proximal, behavior, mask, correction="tis", cap=3.0)
    scale = batch_weight_scale(weight, mask, "token")
    close(scale, (2 + 2 + 0.5 + 3) / 4)  # token weights 2, 2 | 0.5, min(4, 3)
    close((weight / scale)[mask].mean(), 1.0)
