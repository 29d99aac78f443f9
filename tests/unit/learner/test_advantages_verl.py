"""The advantage estimators (``algorithms/advantages.py``) with verl's numbers
(``core_algos.py``, ``masked_whiten``): GRPO's unbiased std, whitening with the unbiased
variance and eps inside the root, REINFORCE++-baseline, pass@k, and the seq-mean
aggregations' row count; then each estimator (GRPO, Dr. GRPO, RLOO, REINFORCE++, GAE),
the per-token rewards and :func:`compute_advantages` on hand-worked batches.

Expected numbers are worked by hand in the comments or by a plain-Python formula
(``statistics``), never by the function under test.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import ConfigError, GrpoConfig, config_from_dict
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    aggregate,
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    grpo_passk_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_level_rewards,
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


# ------------------------------------------------------------ advantages


def test_grpo_advantage_of_one_group_is_reward_minus_mean_over_unbiased_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([7, 7, 7, 7])
    # mean = 2/4 = 0.5; unbiased variance (verl) = (4 * 0.25) / 3 = 1/3, std = 0.57735
    # (1 - 0.5) / (0.57735 + 1e-6) = 0.866024, (0 - 0.5) / ... = -0.866024
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected = torch.tensor([a, -a, -a, a])
    advantages = grpo_advantages(rewards, group_ids)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_grpo_is_registered_under_its_config_name():
    assert ADVANTAGES["grpo"].fn is grpo_advantages
    assert ADVANTAGES["grpo"].config is GrpoConfig


def test_grpo_normalises_interleaved_groups_independently():
    # group 0 at positions 0, 2, 4: rewards 3, 1, 2 -> mean 2, deviations 1, -1, 0
    #   unbiased std = sqrt((1 + 1 + 0) / 2) = 1
    # group 1 at positions 1, 3: rewards 10, 0 -> mean 5, deviations 5, -5,
    #   unbiased std = sqrt((25 + 25) / 1) = sqrt(50): 5 / sqrt(50) = 1 / sqrt(2)
    rewards = torch.tensor([3.0, 10.0, 1.0, 0.0, 2.0])
    group_ids = torch.tensor([0, 1, 0, 1, 0])
    h = 1 / math.sqrt(2.0)
    expected = torch.tensor([1.0, h, -1.0, -h, 0.0])
    advantages = grpo_advantages(rewards, group_ids)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_grpo_without_std_normalisation_only_centres_each_group():
    rewards = torch.tensor([3.0, 10.0, 1.0, 0.0, 2.0])
    group_ids = torch.tensor([0, 1, 0, 1, 0])
    # group 0 mean (3 + 1 + 2) / 3 = 2; group 1 mean (10 + 0) / 2 = 5
    expected = torch.tensor([3.0 - 2.0, 10.0 - 5.0, 1.0 - 2.0, 0.0 - 5.0, 2.0 - 2.0])
    advantages = grpo_advantages(rewards, group_ids, normalize_std=False)
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)


def test_grpo_gives_a_group_of_one_zero_advantage():
    rewards = torch.tensor([0.7, 1.0, 0.0])
    group_ids = torch.tensor([5, 6, 6])
    advantages = grpo_advantages(rewards, group_ids)
    assert advantages[0].item() == 0.0
    # group 6: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 1/sqrt(2) -> +-1/sqrt(2)
    h = 1 / math.sqrt(2.0)
    torch.testing.assert_close(advantages[1:], torch.tensor([h, -h]), atol=1e-5, rtol=0)


def test_grpo_gives_a_group_with_equal_rewards_zero_advantage_and_no_nan():
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.3])
    group_ids = torch.tensor([1, 1, 1, 1])
    for normalize_std in (True, False):
        advantages = grpo_advantages(rewards, group_ids, normalize_std=normalize_std)
        assert torch.isfinite(advantages).all()
        assert torch.equal(advantages, torch.zeros(4))


def test_dr_grpo_centres_each_group_and_never_divides_by_the_std():
    # group 0 (positions 0, 2, 4): 3, 1, 2 -> mean 2 -> 1, -1, 0
    # group 1 (positions 1, 3): 10, 0 -> mean 5 -> 5, -5 (GRPO would give +-1)
    rewards = torch.tensor([3.0, 10.0, 1.0, 0.0, 2.0])
    group_ids = torch.tensor([0, 1, 0, 1, 0])
    close(dr_grpo_advantages(rewards, group_ids), [1.0, 5.0, -1.0, -5.0, 0.0])


def test_dr_grpo_gives_a_group_of_one_and_an_equal_group_zero():
    rewards = torch.tensor([0.7, 0.4, 0.4, 0.4])
    group_ids = torch.tensor([0, 1, 1, 1])
    assert torch.equal(dr_grpo_advantages(rewards, group_ids), torch.zeros(4))


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1)/3 = 2/3, A_1 = 0 - (1 + 0 + 1)/3 = -2/3
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    close(
        rloo_advantages(rewards, torch.zeros(4, dtype=torch.long)), [2 / 3, -2 / 3, -2 / 3, 2 / 3]
    )


def test_rloo_handles_interleaved_groups_a_group_of_one_and_equal_rewards():
    # group 0 (positions 0, 2, 4): 3, 1, 2 -> 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0
    # group 1 (position 1) alone -> 0; group 2 (positions 3, 5) equal -> 0
    rewards = torch.tensor([3.0, 9.0, 1.0, 0.5, 2.0, 0.5])
    group_ids = torch.tensor([0, 1, 0, 2, 0, 2])
    advantages = rloo_advantages(rewards, group_ids)
    close(advantages, [1.5, 0.0, -1.5, 0.0, 0.0, 0.0])
    assert advantages[1].item() == 0.0 and advantages[3].item() == 0.0


def test_grpo_equal_rewards_that_do_not_average_exactly_still_give_exact_zero():
    # in float32 the mean of seven 0.3s is 0.3 + 3e-8: that rounding over (std 3e-8 + eps 1e-6)
    # would be a fake advantage of about 0.03
    rewards = torch.full((7,), 0.3)
    for name in ("grpo", "dr_grpo", "rloo"):
        advantages, _ = compute_advantages(
            name, rewards=rewards, group_ids=torch.zeros(7), mask=torch.ones(7, 2)
        )
        assert torch.equal(advantages, torch.zeros(7, 2)), name


def test_compute_advantages_broadcasts_outcome_advantages_to_valid_tokens_only():
    # one group [1, 0] -> grpo +-0.5 / (unbiased std 1/sqrt(2)) = +-1/sqrt(2);
    # sample 0 has 2 valid tokens, sample 1 has 1
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    advantages, returns = compute_advantages(
        "grpo", rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([3, 3]), mask=mask
    )
    h = 1 / math.sqrt(2.0)
    close(advantages, [[h, h, 0.0], [-h, 0.0, 0.0]])
    assert advantages.dtype == torch.float32
    assert returns is None


def test_compute_advantages_passes_normalize_std_to_grpo():
    # one group [4, 0]: mean 2 -> +2, -2 without the std (2)
    advantages, _ = compute_advantages(
        "grpo",
        rewards=torch.tensor([4.0, 0.0]),
        group_ids=torch.tensor([0, 0]),
        mask=torch.ones(2, 1),
        normalize_std=False,
    )
    close(advantages, [[2.0], [-2.0]])


def test_outcome_methods_use_the_row_sum_of_token_rewards_when_given():
    # row sums: 0 + 0 + 1 = 1 and 0 + 0.5 = 0.5 (the 7 is masked): dr_grpo -> +0.25, -0.25
    token_rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, _ = compute_advantages(
        "dr_grpo",
        rewards=torch.tensor([100.0, -100.0]),  # ignored
        group_ids=torch.tensor([0, 0]),
        mask=mask,
        token_rewards=token_rewards,
    )
    close(advantages, [[0.25, 0.25, 0.25], [-0.25, -0.25, 0.0]])


def test_an_unknown_advantage_raises_value_error():
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages(
            "ppo", rewards=torch.zeros(1), group_ids=torch.zeros(1), mask=torch.ones(1, 1)
        )


# --------------------------------------------------- token-level rewards


def test_token_level_rewards_puts_the_reward_on_the_last_valid_token():
    # row 0 ends at t = 1; row 1 has a hole at t = 1 and ends at t = 2; row 2 has no token
    rewards = torch.tensor([2.0, 5.0, 7.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    close(token_level_rewards(rewards, mask), [[0, 2, 0], [0, 0, 5], [0, 0, 0]])


def test_token_level_rewards_subtracts_the_kl_penalty_on_every_valid_token():
    rewards = torch.tensor([2.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 9.0, 0.4]])
    # kl_coef 0.5: row 0 [-0.05, 2 - 0.1, 0]; row 1 [-0.15, 0, 5 - 0.2]
    got = token_level_rewards(rewards, mask, kl=kl, kl_coef=0.5)
    close(got, [[-0.05, 1.9, 0.0], [-0.15, 0.0, 4.8]])


# ----------------------------------------------------------- REINFORCE++


def test_reinforce_pp_discounts_over_valid_tokens_then_whitens_over_the_batch():
    # gamma 0.5. row 0 rewards [0, 0, 4] -> returns [0 + 0.5 * 2, 0 + 0.5 * 4, 4] = [1, 2, 4]
    # row 1 rewards [2, (99 masked), 4] -> the hole is skipped: [2 + 0.5 * 4, -, 4] = [4, -, 4]
    # valid returns {1, 2, 4, 4, 4}: mean 3, deviations -2, -1, 1, 1, 1,
    # unbiased variance (verl's masked_whiten) (4 + 1 + 1 + 1 + 1) / 4 = 2
    token_rewards = torch.tensor([[0.0, 0.0, 4.0], [2.0, 99.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    s = math.sqrt(2.0)
    expected = [[-2 / s, -1 / s, 1 / s], [1 / s, 0.0, 1 / s]]
    close(reinforce_pp_advantages(token_rewards, mask, gamma=0.5), expected)


def test_reinforce_pp_without_discount_sums_future_rewards():
    # gamma 1. row 0 rewards [0, 1, 2] -> [3, 3, 2]; row 1 [0, (9), 1] -> [1, -, 1]
    # {3, 3, 2, 1, 1}: mean 2, deviations 1, 1, 0, -1, -1, unbiased variance 4/4 = 1
    token_rewards = torch.tensor([[0.0, 1.0, 2.0], [0.0, 9.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    s = 1.0
    expected = [[1 / s, 1 / s, 0.0], [-1 / s, 0.0, -1 / s]]
    advantages, returns = compute_advantages(
        "reinforce_pp",
        rewards=torch.zeros(2),
        group_ids=torch.arange(2),
        mask=mask,
        token_rewards=token_rewards,
    )
    close(advantages, expected)
    assert returns is None


def test_reinforce_pp_from_scalar_rewards_places_them_on_the_last_token():
    # rewards 1 and 0, gamma 1: returns row 0 [1, 1], row 1 [0, -]; {1, 1, 0}
    # mean 2/3, deviations 1/3, 1/3, -2/3, unbiased variance (1/9 + 1/9 + 4/9) / 2 = 1/3
    mask = torch.tensor([[1, 1], [1, 0]])
    advantages, _ = compute_advantages(
        "reinforce_pp", rewards=torch.tensor([1.0, 0.0]), group_ids=torch.arange(2), mask=mask
    )
    s = math.sqrt(1 / 3)
    close(advantages, [[1 / 3 / s, 1 / 3 / s], [-2 / 3 / s, 0.0]])


# ------------------------------------------------------------------- GAE


def test_gae_without_discount_is_the_return_minus_the_value_then_whitened():
    # gamma = lam = 1: A_t = sum of future rewards - V_t. rewards [0, 0, 1], V [0.2, 0.4, 0.6]
    # -> raw A [0.8, 0.6, 0.4], returns A + V = [1, 1, 1]
    # whitened: mean 0.6, deviations 0.2, 0, -0.2, unbiased variance 0.08 / 2 = 0.04,
    # std 0.2 -> [1, 0, -1]
    token_rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6]])
    advantages, returns = gae_advantages(token_rewards, values, torch.ones(1, 3))
    close(returns, [[1.0, 1.0, 1.0]])
    close(advantages, [[1.0, 0.0, -1.0]])


def test_gae_with_gamma_and_lambda_follows_the_recursion():
    # gamma = lam = 0.5, rewards [0, 0, 1], V [0.2, 0.4, 0.6], terminal value 0
    # delta_2 = 1 + 0.5 * 0 - 0.6 = 0.4        A_2 = 0.4
    # delta_1 = 0 + 0.5 * 0.6 - 0.4 = -0.1     A_1 = -0.1 + 0.25 * 0.4 = 0
    # delta_0 = 0 + 0.5 * 0.4 - 0.2 = 0        A_0 = 0 + 0.25 * 0 = 0
    # returns = A + V = [0.2, 0.4, 1.0]; whitening {0, 0, 0.4}: deviations -a, -a, 2a with
    # a = 0.4/3, unbiased std = a * sqrt((1 + 1 + 4) / 2) = a * sqrt(3)
    # -> [-1/sqrt3, -1/sqrt3, 2/sqrt3]
    advantages, returns = compute_advantages(
        "gae",
        rewards=torch.tensor([1.0]),  # placed on the last token
        group_ids=torch.tensor([0]),
        mask=torch.ones(1, 3),
        values=torch.tensor([[0.2, 0.4, 0.6]]),
        gamma=0.5,
        lam=0.5,
    )
    close(returns, [[0.2, 0.4, 1.0]])
    r3 = math.sqrt(3.0)
    close(advantages, [[-1 / r3, -1 / r3, 2 / r3]])


def test_gae_skips_masked_positions_inside_a_row():
    # mask [1, 0, 1]: the value after t = 0 is V_2, not the masked V_1 = 99
    # gamma = lam = 0.5: delta_2 = 1 - 0.6 = 0.4, A_2 = 0.4
    # delta_0 = 0 + 0.5 * 0.6 - 0.2 = 0.1, A_0 = 0.1 + 0.25 * 0.4 = 0.2
    # returns [0.4, 0, 1.0]; whitening {0.2, 0.4}: mean 0.3, unbiased std
    # sqrt((0.01 + 0.01) / 1) = 0.1 * sqrt(2) -> [-1/sqrt2, 0, 1/sqrt2]
    advantages, returns = gae_advantages(
        torch.tensor([[0.0, 9.0, 1.0]]),
        torch.tensor([[0.2, 99.0, 0.6]]),
        torch.tensor([[1, 0, 1]]),
        gamma=0.5,
        lam=0.5,
    )
    close(returns, [[0.4, 0.0, 1.0]])
    h = 1 / math.sqrt(2.0)
    close(advantages, [[-h, 0.0, h]], atol=1e-4)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages(
            "gae", rewards=torch.ones(1), group_ids=torch.zeros(1), mask=torch.ones(1, 2)
        )


def _reference_returns(rewards: list[list[float]], mask: list[list[int]], gamma: float):
    """Discounted reward-to-go over valid tokens, in plain Python."""
    out = []
    for row_r, row_m in zip(rewards, mask, strict=True):
        valid = [t for t, m in enumerate(row_m) if m]
        row = [0.0] * len(row_r)
        for i, t in enumerate(valid):
            row[t] = sum(gamma**j * row_r[u] for j, u in enumerate(valid[i:]))
        out.append(row)
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda b: st.integers(1, 6).flatmap(
            lambda t: st.tuples(
                st.lists(
                    st.lists(st.floats(-2, 2, width=32), min_size=t, max_size=t),
                    min_size=b,
                    max_size=b,
                ),
                st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b),
                st.lists(
                    st.lists(st.floats(-2, 2, width=32), min_size=t, max_size=t),
                    min_size=b,
                    max_size=b,
                ),
            )
        )
    ),
    st.sampled_from([1.0, 0.9, 0.5, 0.0]),
)
def test_gae_returns_with_lambda_one_are_the_discounted_return_whatever_the_values(data, gamma):
    # With lam = 1 the deltas telescope: A_t + V_t = sum_k gamma^k r_(t+k) over valid tokens.
    rewards, mask, values = data
    returns = _reference_returns(rewards, [[int(m) for m in row] for row in mask], gamma)
    advantages, got = gae_advantages(
        torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma=gamma, lam=1.0
    )
    close(got, returns, atol=1e-4)
    assert torch.isfinite(advantages).all()
    assert torch.equal(
        advantages[~torch.tensor(mask)], torch.zeros(int((~torch.tensor(mask)).sum()))
    )


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_every_advantage_of_an_all_masked_batch_is_zero_and_finite(name):
    mask = torch.zeros(3, 4)
    advantages, returns = compute_advantages(
        name,
        rewards=torch.tensor([1.0, 0.0, 2.0]),
        group_ids=torch.tensor([0, 0, 1]),
        mask=mask,
        values=torch.randn(3, 4),
    )
    assert torch.equal(advantages, torch.zeros(3, 4))
    if returns is not None:
        assert torch.equal(returns, torch.zeros(3, 4))


@pytest.mark.parametrize("name", ["reinforce_pp", "gae"])
def test_a_batch_with_one_valid_token_whitens_to_zero(name):
    mask = torch.tensor([[0, 1, 0]])
    advantages, _ = compute_advantages(
        name,
        rewards=torch.tensor([3.0]),
        group_ids=torch.tensor([0]),
        mask=mask,
        values=torch.tensor([[0.0, 0.5, 0.0]]),
    )
    assert torch.equal(advantages, torch.zeros(1, 3))
