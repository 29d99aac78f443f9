"""Advantages and whitening with verl's numbers (``core_algos.py``, ``masked_whiten``):
GRPO's unbiased std, whitening with the unbiased variance and eps inside the root,
REINFORCE++-baseline, pass@k, and the seq-mean aggregations' row count.

Expected numbers are worked by hand in the comments or by a plain-Python formula
(``statistics``), never by the function under test.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from asyncrl.config import ConfigError, config_from_dict
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    aggregate,
    compute_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    masked_whiten,
    reinforce_pp_baseline_advantages,
)
from tests.helpers.tensors import close

torch.set_num_threads(1)


# ----------------------------------------------------------------------- GRPO


def test_grpo_divides_by_the_unbiased_std_plus_eps_as_verl():
    # group [1, 2, 4]: mean 7/3, sample std sqrt(((4/3)^2 + (1/3)^2 + (5/3)^2) / 2) = sqrt(7/3)
    rewards = [1.0, 2.0, 4.0]
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)
    assert std == pytest.approx(math.sqrt(7 / 3))
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    close(grpo_advantages(torch.tensor(rewards), torch.zeros(3)), expected, atol=1e-6)


def test_grpo_gives_a_lone_sample_and_an_equal_group_exactly_zero():
    # verl: a lone sample keeps its raw score 5 (baseline 0, std 1); we give 0 on purpose.
    # An equal group [2, 2] is 0 in verl too: (2 - 2) / (0 + 1e-6).
    rewards = torch.tensor([5.0, 2.0, 2.0, 1.0, 0.0])
    group_ids = torch.tensor([0, 1, 1, 2, 2])
    h = 0.5 / (math.sqrt(0.5) + 1e-6)  # group 2: mean 0.5, sample std sqrt(0.5)
    advantages = grpo_advantages(rewards, group_ids)
    assert torch.equal(advantages[:3], torch.zeros(3))
    close(advantages[3:], [h, -h], atol=1e-6)


# ----------------------------------------------------------------- whitening


def test_masked_whiten_uses_the_unbiased_variance_over_valid_tokens():
    values = torch.tensor([[1.0, 2.0, 99.0], [3.0, -99.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # valid {1, 2, 3, 6}: mean 3, deviations -2, -1, 0, 3; unbiased variance 14 / 3
    s = math.sqrt(14 / 3 + 1e-8)
    close(masked_whiten(values, mask), [[-2 / s, -1 / s, 0.0], [0.0, 0.0, 3 / s]])


def test_masked_whiten_puts_eps_inside_the_square_root():
    # {0, 1e-4}: deviations -+5e-5, unbiased variance 2 * (5e-5)^2 / 1 = 5e-9:
    # 5e-5 / sqrt(5e-9 + 1e-8) = 0.408248; the old (x - mean) / (std + 1e-6) gave 0.697
    got = masked_whiten(torch.tensor([[0.0, 1e-4]]), torch.ones(1, 2))
    a = 5e-5 / math.sqrt(1.5e-8)
    close(got, [[-a, a]], atol=1e-4)
    assert a == pytest.approx(0.408248, abs=1e-6)


def test_masked_whiten_of_one_token_none_or_equal_values_is_exactly_zero():
    # verl raises for one valid token or none; equal values there give rounding * 1e4
    assert torch.equal(
        masked_whiten(torch.tensor([[4.0, 7.0]]), torch.tensor([[0, 1]])), torch.zeros(1, 2)
    )
    assert torch.equal(masked_whiten(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
    assert torch.equal(masked_whiten(torch.full((1, 7), 0.3), torch.ones(1, 7)), torch.zeros(1, 7))


# ----------------------------------------------------- REINFORCE++-baseline


def test_reinforce_pp_baseline_centres_in_the_group_then_whitens_over_tokens():
    # group 0: samples 0 (reward 1, 2 tokens) and 1 (reward 0, 1 token): +0.5, -0.5
    # group 1: samples 2 (1 token) and 3 (2 tokens), rewards 1 and 1: 0, 0
    # tokens {0.5, 0.5, -0.5, 0, 0, 0}: mean 1/12, deviations 5/12, 5/12, -7/12, -1/12 x3
    # unbiased variance (25 + 25 + 49 + 1 + 1 + 1) / 144 / 5 = 102 / 720
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]])
    s = math.sqrt(102 / 720 + 1e-8)
    a, b, c = 5 / 12 / s, -7 / 12 / s, -1 / 12 / s
    expected = [[a, a, 0.0], [b, 0.0, 0.0], [0.0, c, 0.0], [c, c, 0.0]]
    advantages, returns = compute_advantages(
        "reinforce_pp_baseline",
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        group_ids=torch.tensor([0, 0, 1, 1]),
        mask=mask,
    )
    close(advantages, expected)
    assert returns is None


def test_reinforce_pp_baseline_scores_are_the_row_sums_of_token_rewards():
    # row sums (the 7 is masked): -0.25 + 1 = 0.75 and 0.25 -> group 0 centred to +-0.25;
    # the lone sample (group 1) is centred to 0 (verl: its raw score, 3)
    token_rewards = torch.tensor([[-0.25, 1.0], [0.25, 7.0], [0.0, 3.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 1]])
    got = reinforce_pp_baseline_advantages(token_rewards, mask, torch.tensor([0, 0, 1]))
    # centred per token: row 0 [0.25, 0.25], row 1 [-0.25, -], row 2 [-, 0]
    # {0.25, 0.25, -0.25, 0}: mean 1/16, deviations 3/16, 3/16, -5/16, -1/16;
    # unbiased variance (9 + 9 + 25 + 1) / 256 / 3 = 44 / 768
    s = math.sqrt(44 / 768 + 1e-8)
    close(got, [[3 / 16 / s, 3 / 16 / s], [-5 / 16 / s, 0.0], [0.0, -1 / 16 / s]])


# -------------------------------------------------------------------- pass@k


def test_grpo_passk_gives_only_the_best_sample_the_gap_to_the_second_over_the_std():
    # group 0 (positions 0, 2, 4): 0.2, 0.9, 0.5 -> best 0.9 at position 2, gap 0.4
    # group 1 (positions 1, 3, 5): 1, 0, 1 -> a tie at the top: all 0
    rewards = torch.tensor([0.2, 1.0, 0.9, 0.0, 0.5, 1.0])
    group_ids = torch.tensor([0, 1, 0, 1, 0, 1])
    gap = 0.4 / (statistics.stdev([0.2, 0.9, 0.5]) + 1e-6)  # stdev 0.351188
    close(grpo_passk_advantages(rewards, group_ids), [0, 0, gap, 0, 0, 0], atol=1e-6)
    plain = grpo_passk_advantages(rewards, group_ids, normalize_std=False)
    close(plain, [0, 0, 0.4, 0, 0, 0], atol=1e-6)


def test_grpo_passk_gives_a_lone_sample_zero_and_is_a_per_sample_estimator():
    assert torch.equal(grpo_passk_advantages(torch.tensor([3.0]), torch.zeros(1)), torch.zeros(1))
    assert ADVANTAGES["grpo_passk"].per_sample
    assert ADVANTAGES["grpo_passk"].knobs == ("normalize_std",)


def test_the_new_estimators_are_configurable_and_passk_needs_groups_of_two():
    base = {"model": {"tiny": {}}}
    config = config_from_dict({**base, "algorithm": {"advantage": "grpo_passk"}})
    assert config.algorithm.normalize_std is True
    config = config_from_dict({**base, "algorithm": {"advantage": "reinforce_pp_baseline"}})
    assert config.algorithm.advantage == "reinforce_pp_baseline"
    with pytest.raises(ConfigError, match="group_size"):
        config_from_dict({**base, "algorithm": {"advantage": "grpo_passk", "group_size": 1}})


# ------------------------------------------------------------- aggregations


def test_seq_mean_aggregations_count_only_rows_with_a_valid_token_by_default():
    values = torch.tensor([[1.0, 2.0], [9.0, 9.0], [0.0, 6.0]])
    mask = torch.tensor([[1, 1], [0, 0], [0, 1]])
    # 2 rows with a valid token (verl's seq_mask): token sums 3 and 6 -> 9 / 2
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(4.5)
    # token means 1.5 and 6 -> 7.5 / 2
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(3.75)
    # Dr. GRPO's constant normalizer still counts every row: 9 / (3 rows * T = 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm").item() == pytest.approx(1.5)
