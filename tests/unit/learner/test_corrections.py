"""Behavior corrections against hand-worked examples: the levels (token, the sequence's
product, its geometric mean), IcePop's two-sided mask, and the batch normalisation scale;
then each correction's weights as the policy loss applies them.

Expected numbers are worked out by hand in the comments.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch

from asyncrl.config import AlgorithmConfig, GrpoConfig
from asyncrl.learner.algorithms import policy_loss
from asyncrl.learner.algorithms.corrections import LEVELS, batch_weight_scale, behavior_weights
from asyncrl.learner.algorithms.registry import CORRECTIONS
from tests.helpers.learner import on_policy_inputs
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


# ----------------------------------------------- through the policy loss


def _two_tokens_with_behavior_ratios(rho0: float, rho1: float):
    """On-policy (r = 1), A = 1 on two valid tokens whose pi_prox / pi_b are rho0, rho1."""
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    proximal = logprobs.detach().clone()
    behavior = proximal - torch.tensor([[math.log(rho0), math.log(rho1)]])
    return logprobs, proximal, behavior, torch.ones(1, 2), torch.ones(1, 2)


@pytest.mark.parametrize(
    ("correction", "expected_loss", "expected_grad"),
    [
        ("none", -(1 + 1) / 2, [-1 / 2, -1 / 2]),  # w = 1, 1
        ("tis", -(2 + 1.5) / 2, [-2 / 2, -1.5 / 2]),  # w = min(4, 2), min(1.5, 2)
        ("mis", -(0 + 1.5) / 2, [0.0, -1.5 / 2]),  # w = 0 (4 > 2 is masked), 1.5
        ("decoupled", -(4 + 1.5) / 2, [-4 / 2, -1.5 / 2]),  # w = 4, 1.5 untruncated
    ],
)
def test_each_correction_weights_tokens_by_its_rule(correction, expected_loss, expected_grad):
    # loss = -sum_t(w_t * r_t * A_t) / 2 tokens with r = 1, A = 1; d/dlogprob_t = -w_t / 2
    logprobs, proximal, behavior, advantages, mask = _two_tokens_with_behavior_ratios(4.0, 1.5)
    loss, stats = policy_loss(
        logprobs, proximal, behavior, advantages, mask, correction=correction, correction_cap=2.0
    )
    loss.backward()
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    close(logprobs.grad, [expected_grad])
    # the raw ratios are reported whatever the correction: mean (4 + 1.5) / 2, max 4
    assert stats["importance_weight_mean"].item() == pytest.approx(2.75, abs=1e-5)
    assert stats["importance_weight_max"].item() == pytest.approx(4.0, abs=1e-5)
    # one of two tokens is above C = 2 (truncated by tis, masked by mis)
    assert stats["importance_truncated_frac"].item() == 0.5


def test_the_default_correction_is_not_none():
    logprobs, proximal, behavior, advantages, mask = _two_tokens_with_behavior_ratios(4.0, 1.5)
    default, _ = policy_loss(logprobs, proximal, behavior, advantages, mask)
    tis, _ = policy_loss(logprobs, proximal, behavior, advantages, mask, correction="tis")
    assert default.item() == tis.item() == pytest.approx(-1.75, abs=1e-5)
    assert GrpoConfig().correction == "tis"


def _sequence_level_batch():
    """Two rows, A = 1, r = 1. Behavior ratios: row 0 [9, 1, (masked e^50)], row 1 [0.5, 2, 1]."""
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], requires_grad=True)
    proximal = logprobs.detach().clone()
    log_rho = torch.tensor([[math.log(9.0), 0.0, 50.0], [math.log(0.5), math.log(2.0), 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return logprobs, proximal, proximal - log_rho, torch.ones(2, 3), mask


@pytest.mark.parametrize(
    ("correction", "expected_loss"),
    [
        # geometric means: row 0 sqrt(9 * 1) = 3, row 1 (0.5 * 2 * 1)^(1/3) = 1; 5 valid tokens
        ("tis", -(2 + 2 + 1 + 1 + 1) / 5),  # row 0 truncated to C = 2 on both tokens
        ("mis", -(0 + 0 + 1 + 1 + 1) / 5),  # row 0 masked as a whole
        ("decoupled", -(3 + 3 + 1 + 1 + 1) / 5),
        ("none", -(1 + 1 + 1 + 1 + 1) / 5),
    ],
)
def test_geometric_level_correction_uses_the_geometric_mean_of_the_valid_tokens(
    correction, expected_loss
):
    logprobs, proximal, behavior, advantages, mask = _sequence_level_batch()
    loss, stats = policy_loss(
        logprobs,
        proximal,
        behavior,
        advantages,
        mask,
        correction=correction,
        correction_level="geometric",
        correction_cap=2.0,
    )
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    # sequence ratios per token 3, 3, 1, 1, 1: mean 9/5, max 3, 2 of 5 tokens above C
    assert stats["importance_weight_mean"].item() == pytest.approx(1.8, abs=1e-5)
    assert stats["importance_weight_max"].item() == pytest.approx(3.0, abs=1e-5)
    assert stats["importance_truncated_frac"].item() == pytest.approx(0.4)


def test_token_level_tis_on_the_same_batch_truncates_token_by_token():
    # token ratios 9, 1 | 0.5, 2, 1 -> min(., 2): 2, 1 | 0.5, 2, 1 -> loss -(6.5) / 5
    logprobs, proximal, behavior, advantages, mask = _sequence_level_batch()
    loss, _ = policy_loss(logprobs, proximal, behavior, advantages, mask, correction="tis")
    assert loss.item() == pytest.approx(-6.5 / 5, abs=1e-5)


def test_an_unknown_correction_level_raises_value_error():
    logprobs, proximal, behavior, advantages, mask = on_policy_inputs()
    with pytest.raises(ValueError, match="correction_level"):
        policy_loss(logprobs, proximal, behavior, advantages, mask, correction_level="batch")
