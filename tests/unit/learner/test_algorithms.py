"""The RL math against hand-worked examples: advantages, losses, aggregation, KL, entropy.

Expected numbers are worked out by hand in the comments, not by re-running the
formula under test.
"""

from __future__ import annotations

import itertools
import math
import typing
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.config import (
    ADVANTAGE_CONFIGS,
    AlgorithmConfig,
    ConfigError,
    GrpoConfig,
    config_from_dict,
    config_warnings,
    load_config,
)
from asyncrl.learner import algorithms
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    aggregate,
    compute_advantages,
    dr_grpo_advantages,
    entropy_from_logits,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    masked_mean,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
    token_logprobs,
    value_loss,
)

torch.set_num_threads(1)


# ------------------------------------------------------------------ advantages


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


# --------------------------------------------------------------- masked mean


def test_masked_mean_averages_only_the_set_positions():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 3) / 3 = 2
    assert masked_mean(values, mask).item() == pytest.approx(2.0)


def test_masked_mean_of_an_empty_mask_is_zero():
    values = torch.tensor([[1.0, 2.0]])
    assert masked_mean(values, torch.zeros(1, 2)).item() == 0.0


# ---------------------------------------------------------------- policy loss


def _on_policy_inputs():
    """Logprobs with grad; proximal and behavior equal to them (ratio 1, weight 1)."""
    torch.manual_seed(0)
    logprobs = (-torch.rand(2, 3) - 0.1).requires_grad_(True)
    proximal = logprobs.detach().clone()
    behavior = proximal.clone()
    advantages = torch.tensor([2.0, -0.5])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logprobs, proximal, behavior, advantages, mask


def test_on_policy_loss_is_minus_the_mean_advantage_over_masked_tokens():
    logprobs, proximal, behavior, advantages, mask = _on_policy_inputs()
    loss, _ = policy_loss(logprobs, proximal, behavior, advantages, mask)
    # masked tokens: two of sample 0 (A = 2) and one of sample 1 (A = -0.5)
    # loss = -(2 + 2 - 0.5) / 3 = -3.5 / 3
    assert loss.item() == pytest.approx(-3.5 / 3, abs=1e-6)


def test_on_policy_gradient_is_minus_advantage_over_token_count_on_masked_tokens():
    logprobs, proximal, behavior, advantages, mask = _on_policy_inputs()
    loss, _ = policy_loss(logprobs, proximal, behavior, advantages, mask)
    loss.backward()
    # d/dlogprob of -(ratio * A)/N at ratio 1 is -A/N, N = 3 masked tokens; 0 where unmasked
    expected = torch.tensor([[-2.0 / 3, -2.0 / 3, 0.0], [0.5 / 3, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=0)


def test_a_ratio_above_one_plus_clip_high_with_positive_advantage_is_clipped_without_gradient():
    # ratio = exp(log 1.5) = 1.5 > 1 + 0.2; positive advantage 1 -> min(1.5, 1.2) = 1.2
    logprobs = torch.tensor([[math.log(1.5)]], requires_grad=True)
    proximal = torch.zeros(1, 1)
    loss, stats = policy_loss(
        logprobs,
        proximal,
        proximal.clone(),
        torch.tensor([1.0]),
        torch.ones(1, 1),
        clip_low=0.2,
        clip_high=0.2,
        correction="none",
    )
    loss.backward()
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)
    assert logprobs.grad.item() == 0.0
    assert stats["clip_frac"].item() == pytest.approx(1.0)


def test_a_ratio_inside_the_clip_range_keeps_its_gradient():
    # ratio = 1.1 within [0.8, 1.2]: surrogate = 1.1 * A, d/dlogprob = ratio * A = 1.1 * 2
    logprobs = torch.tensor([[math.log(1.1)]], requires_grad=True)
    proximal = torch.zeros(1, 1)
    loss, stats = policy_loss(
        logprobs, proximal, proximal.clone(), torch.tensor([2.0]), torch.ones(1, 1)
    )
    loss.backward()
    assert loss.item() == pytest.approx(-2.2, abs=1e-6)
    assert logprobs.grad.item() == pytest.approx(-2.2, abs=1e-6)
    assert stats["clip_frac"].item() == 0.0


def test_tis_truncates_a_behavior_weight_of_four_to_the_cap_of_two():
    logprobs, proximal, _, advantages, mask = _on_policy_inputs()
    # behavior lower than proximal by log 4: raw weight pi_prox / pi_behavior = 4, capped at 2
    behavior = proximal - math.log(4.0)
    plain, _ = policy_loss(logprobs, proximal, proximal.clone(), advantages, mask)
    loss, stats = policy_loss(
        logprobs, proximal, behavior, advantages, mask, correction="tis", correction_cap=2.0
    )
    # every masked token weighted by 2: loss = 2 * -(3.5 / 3)
    assert loss.item() == pytest.approx(2.0 * plain.item(), abs=1e-5)
    assert loss.item() == pytest.approx(2.0 * -3.5 / 3, abs=1e-5)
    assert stats["importance_truncated_frac"].item() == pytest.approx(1.0)
    assert stats["importance_weight_mean"].item() == pytest.approx(4.0, rel=1e-5)
    assert stats["importance_weight_max"].item() == pytest.approx(4.0, rel=1e-5)


def test_tis_below_the_cap_weights_by_the_raw_ratio_and_truncates_nothing():
    logprobs, proximal, _, advantages, mask = _on_policy_inputs()
    # raw weight exp(log 1.5) = 1.5 < cap 2
    behavior = proximal - math.log(1.5)
    loss, stats = policy_loss(logprobs, proximal, behavior, advantages, mask)
    assert loss.item() == pytest.approx(1.5 * -3.5 / 3, abs=1e-5)
    assert stats["importance_truncated_frac"].item() == 0.0


def test_correction_none_ignores_the_behavior_logprobs():
    logprobs, proximal, _, advantages, mask = _on_policy_inputs()
    far_behavior = proximal - 5.0
    loss, stats = policy_loss(logprobs, proximal, far_behavior, advantages, mask, correction="none")
    assert loss.item() == pytest.approx(-3.5 / 3, abs=1e-6)
    # the raw weight is still reported, e^5, but not applied
    assert stats["importance_weight_mean"].item() == pytest.approx(math.exp(5.0), rel=1e-5)


def test_masked_tokens_contribute_nothing_whatever_their_values():
    logprobs, proximal, behavior, advantages, mask = _on_policy_inputs()
    base, _ = policy_loss(logprobs, proximal, behavior, advantages, mask)
    wild_proximal = proximal.clone()
    wild_behavior = behavior.clone()
    unmasked = mask == 0
    wild_proximal[unmasked] = -30.0
    wild_behavior[unmasked] = -90.0
    loss, stats = policy_loss(logprobs, wild_proximal, wild_behavior, advantages, mask)
    loss.backward()
    assert loss.item() == pytest.approx(base.item(), abs=1e-6)
    assert torch.equal(logprobs.grad[unmasked], torch.zeros(int(unmasked.sum())))
    # statistics are over masked tokens only: the weights there are all 1
    assert stats["importance_weight_max"].item() == pytest.approx(1.0)


def test_a_fully_masked_batch_gives_zero_loss_and_no_nan():
    logprobs, proximal, behavior, advantages, _ = _on_policy_inputs()
    mask = torch.zeros(2, 3)
    loss, stats = policy_loss(logprobs, proximal, behavior, advantages, mask)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logprobs.grad).all()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    for name, value in stats.items():
        assert torch.isfinite(value).all(), name


def test_an_unknown_correction_raises_value_error():
    logprobs, proximal, behavior, advantages, mask = _on_policy_inputs()
    with pytest.raises(ValueError, match="unknown correction"):
        policy_loss(logprobs, proximal, behavior, advantages, mask, correction="vtrace")


# ------------------------------------------------------------- token logprobs


def test_token_logprobs_gathers_the_log_softmax_of_the_target_tokens():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 6)
    targets = torch.randint(0, 6, (2, 4))
    got = token_logprobs(logits, targets)
    for b in range(2):
        for t in range(4):
            row = logits[b, t]
            # log p = z_y - log sum_j exp z_j
            expected = row[targets[b, t]] - torch.logsumexp(row, dim=0)
            assert got[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_token_logprobs_divides_logits_by_the_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    targets = torch.tensor([[0]])
    # at T = 0.5 the logits become [4, 0]: log p(0) = 4 - log(e^4 + 1)
    expected = 4.0 - math.log(math.exp(4.0) + 1.0)
    got = token_logprobs(logits, targets, temperature=0.5)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    # and at T = 1: 2 - log(e^2 + 1)
    assert token_logprobs(logits, targets).item() == pytest.approx(
        2.0 - math.log(math.exp(2.0) + 1.0), abs=1e-6
    )


def test_token_logprobs_computes_in_float32_from_half_precision_logits():
    logits = torch.tensor([[[1.0, 3.0, -1.0]]], dtype=torch.bfloat16)
    got = token_logprobs(logits, torch.tensor([[1]]))
    assert got.dtype == torch.float32
    # 3 - log(e^1 + e^3 + e^-1)
    expected = 3.0 - math.log(math.exp(1.0) + math.exp(3.0) + math.exp(-1.0))
    assert got.item() == pytest.approx(expected, abs=1e-5)


def test_a_ratio_below_one_minus_clip_low_with_negative_advantage_is_clipped_without_gradient():
    # ratio = 0.5 < 1 - 0.2, A = -1: min(0.5 * -1, 0.8 * -1) = -0.8, so loss = 0.8, no gradient
    logprobs = torch.tensor([[math.log(0.5)]], requires_grad=True)
    proximal = torch.zeros(1, 1)
    loss, stats = policy_loss(
        logprobs, proximal, proximal.clone(), torch.tensor([-1.0]), torch.ones(1, 1)
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.8, abs=1e-6)
    assert logprobs.grad.item() == 0.0
    assert stats["clip_frac"].item() == pytest.approx(1.0)


def test_the_tis_weight_scales_the_gradient_but_is_not_differentiated():
    # on-policy ratio 1, raw weight 4 capped at 2: gradient = -2 * A / N with A = 3, N = 1
    logprobs = torch.tensor([[-0.5]], requires_grad=True)
    proximal = logprobs.detach().clone()
    behavior = proximal - math.log(4.0)
    loss, _ = policy_loss(logprobs, proximal, behavior, torch.tensor([3.0]), torch.ones(1, 1))
    loss.backward()
    assert logprobs.grad.item() == pytest.approx(-6.0, abs=1e-5)


# ------------------------------------------------------- more outcome advantages


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0)


def test_every_config_name_has_an_estimator_and_every_estimator_a_config_name():
    assert set(ADVANTAGE_CONFIGS) == set(ADVANTAGES)
    for name, estimator in ADVANTAGES.items():
        assert ADVANTAGE_CONFIGS[name] is estimator.config
    per_sample = {name for name, e in ADVANTAGES.items() if e.per_sample}
    assert per_sample == {"grpo", "dr_grpo", "rloo", "grpo_passk"}
    assert set(CORRECTIONS) == set(
        typing.get_args(AlgorithmConfig.model_fields["correction"].annotation)
    )
    assert set(AGGREGATIONS) == set(
        typing.get_args(AlgorithmConfig.model_fields["aggregation"].annotation)
    )
    assert set(KL_ESTIMATORS) == set(
        typing.get_args(AlgorithmConfig.model_fields["kl_estimator"].annotation)
    )


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


# ---------------------------------------------------------- token-level rewards


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


# ----------------------------------------------------------------- REINFORCE++


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


# ------------------------------------------------------------------------ GAE


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


# ----------------------------------------------------------------- aggregation

AGG_VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # (mean(1, 2) + mean(4)) / 2 = (1.5 + 4) / 2
        ("seq-mean-token-sum", 3.5),  # ((1 + 2) + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # (1 + 2 + 4) / (2 sequences * T = 3)
    ],
)
def test_aggregate_modes_on_a_hand_worked_batch(mode, expected):
    assert aggregate(AGG_VALUES, AGG_MASK, mode).item() == pytest.approx(expected, abs=1e-6)


def test_aggregate_uses_the_global_normalizers_it_is_given():
    # sum of valid values 7, per-sequence means sum 5.5
    assert aggregate(AGG_VALUES, AGG_MASK, "token-mean", num_tokens=14).item() == 0.5
    got = aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-mean", num_sequences=11)
    assert got.item() == pytest.approx(0.5)
    got = aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-sum", num_sequences=7)
    assert got.item() == pytest.approx(1.0)
    got = aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-sum-norm", num_sequences=2, norm_length=7)
    assert got.item() == pytest.approx(0.5)  # 7 / (2 * 7)
    # a tensor count (e.g. all-reduced over ranks) works as well
    assert aggregate(AGG_VALUES, AGG_MASK, "token-mean", num_tokens=torch.tensor(14)).item() == 0.5


def test_seq_mean_token_mean_counts_a_row_without_tokens_as_zero_and_one_token_as_itself():
    values = torch.tensor([[1.0, 2.0], [9.0, 9.0], [0.0, 6.0]])
    mask = torch.tensor([[1, 1], [0, 0], [0, 1]])
    # (mean(1, 2) + 0 + 6) / 2 rows with a valid token (as verl) = 7.5 / 2
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(3.75)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_ignores_nan_and_inf_at_masked_positions_and_of_all_masked_is_zero(mode):
    values = torch.tensor([[1.0, float("nan")], [float("inf"), -float("inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0], [0, 0]])
    assert math.isfinite(aggregate(values, mask, mode).item())
    empty = aggregate(values, torch.zeros(2, 2), mode)
    empty.backward()
    assert empty.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 2))


def test_an_unknown_aggregation_raises_value_error():
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(AGG_VALUES, AGG_MASK, "sum")


# ------------------------------------------------- micro-batches add up exactly


def _off_policy_batch(seed: int = 0):
    """B = 6, T = 5 with a fully masked row, a one-token row and ratios off 1 both ways."""
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 5
    logprobs = -torch.rand(B, T, generator=g) * 2
    proximal = logprobs + 0.4 * torch.randn(B, T, generator=g)
    behavior = proximal + 0.8 * torch.randn(B, T, generator=g)
    advantages = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[2] = False
    mask[4] = False
    mask[4, 1] = True
    return logprobs, proximal, behavior, advantages, mask


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize(("correction", "level"), [("tis", "token"), ("mis", "sequence")])
def test_micro_batches_with_global_normalizers_sum_to_the_full_batch_loss_and_gradient(
    mode, correction, level
):
    base, proximal, behavior, advantages, mask = _off_policy_batch()
    B, T = mask.shape
    # the seq-mean modes count the rows with a valid token (5 of 6, as verl); Dr. GRPO's
    # constant normalizer counts every row
    sequences = B if mode == "seq-mean-token-sum-norm" else int(mask.any(-1).sum())
    globals_ = {"num_tokens": mask.sum().item(), "num_sequences": sequences, "norm_length": T}
    kwargs = {
        "clip_c": 3.0,
        "correction": correction,
        "correction_level": level,
        "aggregation": mode,
    }

    full_lp = base.clone().requires_grad_(True)
    full, _ = policy_loss(full_lp, proximal, behavior, advantages, mask, **kwargs, **globals_)
    full.backward()
    # without explicit normalizers, the full batch uses exactly these
    default, _ = policy_loss(full_lp.detach(), proximal, behavior, advantages, mask, **kwargs)
    assert default.item() == pytest.approx(full.item(), abs=1e-6)

    split_lp = base.clone().requires_grad_(True)
    total = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        part, _ = policy_loss(
            split_lp[rows],
            proximal[rows],
            behavior[rows],
            advantages[rows],
            mask[rows],
            **kwargs,
            **globals_,
        )
        part.backward()  # gradient accumulation: one backward per micro-batch
        total = total + part.detach()
    assert total.item() == pytest.approx(full.item(), abs=1e-5)
    torch.testing.assert_close(split_lp.grad, full_lp.grad, atol=1e-6, rtol=1e-5)
    assert full_lp.grad.abs().sum() > 0


@settings(max_examples=30, deadline=None)
@given(
    st.sampled_from(list(AGGREGATIONS)),
    st.integers(0, 10_000),
    st.lists(st.integers(1, 7), min_size=1, max_size=4),
)
def test_any_split_into_micro_batches_sums_to_the_full_batch_aggregate(mode, seed, cuts):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(8, 4, generator=g)
    mask = torch.rand(8, 4, generator=g) > 0.5
    normalizers = {"num_tokens": mask.sum().item(), "num_sequences": 8, "norm_length": 4}
    full = aggregate(values, mask, mode, **normalizers)
    bounds = [0, *sorted(set(cuts)), 8]
    parts = sum(
        aggregate(values[a:b], mask[a:b], mode, **normalizers).item()
        for a, b in itertools.pairwise(bounds)
    )
    assert parts == pytest.approx(full.item(), abs=1e-5)


# ------------------------------------------------------- policy loss: clipping


def _one_token_loss(ratio: float, advantage: float, **kwargs):
    """The loss and d loss / d logprob for one on-mask token with the given ratio, weight 1."""
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    proximal = torch.zeros(1, 1)
    loss, stats = policy_loss(
        logprobs,
        proximal,
        proximal.clone(),
        torch.tensor([[advantage]]),
        torch.ones(1, 1),
        **kwargs,
    )
    loss.backward()
    return loss.item(), logprobs.grad.item(), stats


def test_asymmetric_clip_uses_clip_high_above_and_clip_low_below():
    # clip_low 0.2, clip_high 0.28: positive A clips above 1.28, negative A below 0.8
    # ratio 1.25, A = 1: inside -> loss -1.25, gradient -ratio * A = -1.25
    loss, grad, stats = _one_token_loss(1.25, 1.0, clip_low=0.2, clip_high=0.28)
    assert (loss, grad) == (pytest.approx(-1.25, abs=1e-6), pytest.approx(-1.25, abs=1e-6))
    assert stats["clip_frac"].item() == 0.0
    # ratio 1.3, A = 1: min(1.3, 1.28) = 1.28 -> loss -1.28, no gradient
    loss, grad, stats = _one_token_loss(1.3, 1.0, clip_low=0.2, clip_high=0.28)
    assert (loss, grad) == (pytest.approx(-1.28, abs=1e-6), 0.0)
    assert stats["clip_frac"].item() == 1.0
    # ratio 0.75, A = -1: min(-0.75, -0.8) = -0.8 -> loss 0.8, no gradient
    loss, grad, _ = _one_token_loss(0.75, -1.0, clip_low=0.2, clip_high=0.28)
    assert (loss, grad) == (pytest.approx(0.8, abs=1e-6), 0.0)
    # ratio 0.75, A = +1: min(0.75, 0.8) = 0.75, the unclipped side keeps the gradient
    loss, grad, _ = _one_token_loss(0.75, 1.0, clip_low=0.2, clip_high=0.28)
    assert (loss, grad) == (pytest.approx(-0.75, abs=1e-6), pytest.approx(-0.75, abs=1e-6))


def test_dual_clip_caps_the_loss_of_a_huge_ratio_on_a_negative_advantage():
    # ratio 5, A = -1: plain PPO min(-5, -1.2) = -5 -> loss 5 with gradient -r * A = 5
    loss, grad, stats = _one_token_loss(5.0, -1.0)
    assert (loss, grad) == (pytest.approx(5.0, abs=1e-5), pytest.approx(5.0, abs=1e-5))
    assert stats["dual_clip_frac"].item() == 0.0
    # with clip_c = 3: max(-5, 3 * -1) = -3 -> loss 3, constant, no gradient
    loss, grad, stats = _one_token_loss(5.0, -1.0, clip_c=3.0)
    assert (loss, grad) == (pytest.approx(3.0, abs=1e-6), 0.0)
    assert stats["dual_clip_frac"].item() == 1.0


def test_dual_clip_leaves_positive_advantages_and_moderate_ratios_alone():
    # A = +1, ratio 5: min(5, 1.2) = 1.2; the dual clip is for A < 0 only
    loss, grad, stats = _one_token_loss(5.0, 1.0, clip_c=3.0)
    assert (loss, grad) == (pytest.approx(-1.2, abs=1e-6), 0.0)
    assert stats["dual_clip_frac"].item() == 0.0
    # A = -1, ratio 2: min(-2, -1.2) = -2 > -3, so the cap does not bind: loss 2, gradient 2
    loss, grad, stats = _one_token_loss(2.0, -1.0, clip_c=3.0)
    assert (loss, grad) == (pytest.approx(2.0, abs=1e-6), pytest.approx(2.0, abs=1e-6))
    assert stats["dual_clip_frac"].item() == 0.0


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="clip_c"):
        _one_token_loss(1.0, 1.0, clip_c=1.0)


def test_policy_loss_accepts_token_advantages_and_sample_advantages_alike():
    logprobs, proximal, behavior, advantages, mask = _on_policy_inputs()
    per_sample, _ = policy_loss(logprobs, proximal, behavior, advantages, mask)
    per_token, _ = policy_loss(
        logprobs, proximal, behavior, advantages.unsqueeze(-1).expand(2, 3), mask
    )
    assert per_token.item() == per_sample.item()


# ------------------------------------------------ policy loss: the corrections


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


def test_a_row_with_one_valid_token_under_every_aggregation():
    # one token, r = 1, A = 2, weight 1: loss -2 per token
    logprobs = torch.tensor([[-0.3, -0.7]], requires_grad=True)
    proximal = logprobs.detach().clone()
    mask = torch.tensor([[0, 1]])
    expected = {
        "token-mean": -2.0,  # -2 / 1 token
        "seq-mean-token-mean": -2.0,  # (-2 / 1) / 1 row
        "seq-mean-token-sum": -2.0,  # -2 / 1 row
        "seq-mean-token-sum-norm": -1.0,  # -2 / (1 row * T = 2)
    }
    for mode, value in expected.items():
        loss, _ = policy_loss(
            logprobs, proximal, proximal.clone(), torch.tensor([2.0]), mask, aggregation=mode
        )
        assert loss.item() == pytest.approx(value, abs=1e-6), mode


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_all_masked_gives_zero_loss_finite_grads_and_finite_stats(mode, correction, level):
    logprobs = torch.tensor([[-0.5, -1.0], [-2.0, -60.0]], requires_grad=True)
    proximal = torch.tensor([[-90.0, 0.0], [-1.0, 0.0]])  # wild values at masked positions
    behavior = torch.tensor([[0.0, -200.0], [float("-inf"), 0.0]])
    loss, stats = policy_loss(
        logprobs,
        proximal,
        behavior,
        torch.tensor([1.0, -1.0]),
        torch.zeros(2, 2),
        clip_c=3.0,
        correction=correction,
        correction_level=level,
        aggregation=mode,
    )
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 2))
    for name, value in stats.items():
        assert torch.isfinite(value).all(), name


def test_extreme_log_ratios_stay_finite():
    # a behavior log-prob of -inf (or a ratio of e^200) must not give inf or NaN
    logprobs = torch.tensor([[0.0, -1.0]], requires_grad=True)
    proximal = torch.tensor([[-200.0, -1.0]])
    behavior = torch.tensor([[float("-inf"), 0.0]])
    loss, stats = policy_loss(
        logprobs, proximal, behavior, torch.tensor([-1.0]), torch.ones(1, 2), correction="decoupled"
    )
    loss.backward()
    assert math.isfinite(loss.item())
    assert torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(v).all() for v in stats.values())


def test_an_unknown_correction_level_raises_value_error():
    logprobs, proximal, behavior, advantages, mask = _on_policy_inputs()
    with pytest.raises(ValueError, match="correction_level"):
        policy_loss(logprobs, proximal, behavior, advantages, mask, correction_level="batch")


def test_ppo_kl_stat_is_zero_on_policy_and_positive_off_policy():
    logprobs, proximal, behavior, advantages, mask = _on_policy_inputs()
    _, stats = policy_loss(logprobs, proximal, behavior, advantages, mask)
    assert stats["ppo_kl"].item() == pytest.approx(0.0, abs=1e-7)
    # one token, ratio 2: k3 = (r - 1) - log r = 1 - log 2
    _, _, stats = _one_token_loss(2.0, 1.0)
    assert stats["ppo_kl"].item() == pytest.approx(1 - math.log(2.0), abs=1e-6)


# ------------------------------------------------------------------- value loss


def _value_loss_one(v: float, old: float, ret: float, clip: float | None = 0.2):
    values = torch.tensor([[v]], requires_grad=True)
    loss, stats = value_loss(
        values, torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1), clip=clip
    )
    loss.backward()
    return loss.item(), values.grad.item(), stats


def test_value_loss_takes_the_clipped_branch_when_it_is_larger():
    # v 1.5, old 1.0, R 2, clip 0.2: clipped v = 1.2
    # (1.5 - 2)^2 = 0.25 < (1.2 - 2)^2 = 0.64 -> 0.5 * 0.64 = 0.32, no gradient (clip saturated)
    loss, grad, stats = _value_loss_one(1.5, 1.0, 2.0)
    assert (loss, grad) == (pytest.approx(0.32, abs=1e-6), 0.0)
    assert stats["value_clip_frac"].item() == 1.0
    assert stats["value_error"].item() == pytest.approx(0.25, abs=1e-6)


def test_value_loss_takes_the_unclipped_branch_when_it_is_larger():
    # v 3, old 1, R 2: clipped v = 1.2; (3 - 2)^2 = 1 > (1.2 - 2)^2 = 0.64 -> 0.5, grad v - R = 1
    loss, grad, stats = _value_loss_one(3.0, 1.0, 2.0)
    assert (loss, grad) == (pytest.approx(0.5, abs=1e-6), pytest.approx(1.0, abs=1e-6))
    assert stats["value_clip_frac"].item() == 0.0
    # inside the clip range both branches agree: v 1.1 -> 0.5 * 0.81, gradient 1.1 - 2 = -0.9
    loss, grad, _ = _value_loss_one(1.1, 1.0, 2.0)
    assert (loss, grad) == (pytest.approx(0.405, abs=1e-6), pytest.approx(-0.9, abs=1e-6))


def test_value_loss_without_clip_is_half_the_squared_error():
    # v 1.5, R 2: 0.5 * 0.25 = 0.125, gradient v - R = -0.5
    loss, grad, stats = _value_loss_one(1.5, 1.0, 2.0, clip=None)
    assert (loss, grad) == (pytest.approx(0.125, abs=1e-6), pytest.approx(-0.5, abs=1e-6))
    assert stats["value_clip_frac"].item() == 0.0


def test_value_loss_aggregates_over_valid_tokens_and_of_all_masked_is_zero():
    values = torch.tensor([[1.0, 3.0, 50.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # no clip: 0.5 * ((1 - 2)^2 + (3 - 2)^2) / 2 tokens = 0.5
    loss, stats = value_loss(values, values.detach(), returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.5)
    assert stats["value_error"].item() == pytest.approx(1.0)
    empty, stats = value_loss(values, values.detach(), returns, torch.zeros(1, 3))
    empty.backward()
    assert empty.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(1, 3))
    assert all(torch.isfinite(v) for v in stats.values())


# ------------------------------------------------------------------------- KL


def test_kl_estimators_on_a_hand_worked_token():
    # pi = 0.5, pi_ref = 0.25: x = log 2
    # k1 = log 2; k2 = (log 2)^2 / 2; k3 = 1/2 - 1 + log 2
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2.0)
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(ln2, abs=1e-6)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(ln2**2 / 2, abs=1e-6)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(0.5 - 1 + ln2, abs=1e-6)
    # the other way round, x = -log 2: k1 is negative, k3 = 2 - 1 - log 2 stays positive
    assert kl_estimate(ref, lp, "k1").item() == pytest.approx(-ln2, abs=1e-6)
    assert kl_estimate(ref, lp, "k3").item() == pytest.approx(1 - ln2, abs=1e-6)


def test_k1_and_k3_are_unbiased_over_a_whole_distribution():
    # pi = [1/2, 1/2], pi_ref = [1/4, 3/4]:
    # KL = 1/2 log(2) + 1/2 log(2/3) = 1/2 log(4/3)
    pi = torch.tensor([[0.5, 0.5]])
    ref = torch.tensor([[0.25, 0.75]])
    kl = 0.5 * math.log(4 / 3)
    for estimator in ("k1", "k3"):
        per_token = kl_estimate(pi.log(), ref.log(), estimator)
        assert (pi * per_token).sum().item() == pytest.approx(kl, abs=1e-6), estimator


def test_kl_estimate_is_differentiable_in_the_policy_logprobs():
    # d k3 / dx = 1 - exp(-x) = 1 - 1/2 at x = log 2; the reference gets no gradient
    lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]], requires_grad=True)
    kl_estimate(lp, ref, "k3").sum().backward()
    assert lp.grad.item() == pytest.approx(0.5, abs=1e-6)
    assert ref.grad is None


def test_an_unknown_kl_estimator_raises_value_error():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_kl_in_the_reward_flows_into_reinforce_pp_returns():
    # reward 1 on the last of 2 tokens, k1 = 0.5 per token, kl_coef 0.2 -> [-0.1, 0.9]
    # gamma 1 returns: [0.8, 0.9]; whitened: mean 0.85, deviations -+0.05,
    # unbiased std sqrt(2 * 0.0025 / 1) = 0.05 * sqrt(2) -> [-1/sqrt2, 1/sqrt2]
    mask = torch.ones(1, 2)
    kl = kl_estimate(torch.full((1, 2), -1.0), torch.full((1, 2), -1.5), "k1")
    token_rewards = token_level_rewards(torch.tensor([1.0]), mask, kl=kl, kl_coef=0.2)
    close(token_rewards, [[-0.1, 0.9]])
    advantages, _ = compute_advantages(
        "reinforce_pp",
        rewards=torch.tensor([1.0]),
        group_ids=torch.tensor([0]),
        mask=mask,
        token_rewards=token_rewards,
    )
    h = 1 / math.sqrt(2.0)
    close(advantages, [[-h, h]], atol=1e-4)


# -------------------------------------------------------------------- entropy


def test_entropy_of_hand_worked_distributions():
    # uniform over 2: log 2. p = [1/4, 3/4] from logits [log 1, log 3]:
    # H = -(1/4 log 1/4 + 3/4 log 3/4) = log 4 - 3/4 log 3
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    expected = [[math.log(2.0), math.log(4.0) - 0.75 * math.log(3.0)]]
    close(entropy_from_logits(logits), expected, atol=1e-6)
    # temperature 2 on doubled logits gives the same distribution
    close(entropy_from_logits(2 * logits, temperature=2.0), expected, atol=1e-6)


def test_entropy_is_float32_from_bfloat16_and_chunks_without_grad():
    torch.manual_seed(3)
    logits = torch.randn(3, 5, 7)
    with torch.no_grad():
        got = entropy_from_logits(logits.to(torch.bfloat16))
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    # a sharp (nearly one-hot) row has entropy near 0; a flat one log V
    sharp = torch.tensor([[[100.0, 0.0, 0.0]]])
    flat = torch.zeros(1, 1, 3)
    assert entropy_from_logits(sharp).item() == pytest.approx(0.0, abs=1e-6)
    assert entropy_from_logits(flat).item() == pytest.approx(math.log(3.0), abs=1e-6)


def test_entropy_in_chunks_equals_one_pass_and_grad_flows_for_a_bonus(monkeypatch):
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 8)
    with_grad = logits.clone().requires_grad_(True)
    bonus = entropy_from_logits(with_grad)  # with grad: one pass
    # without grad, 16 elements per chunk is 2 rows of V = 8: the 6 rows take 3 chunks
    monkeypatch.setattr(algorithms.logprobs, "ENTROPY_CHUNK_ELEMENTS", 16)
    with torch.no_grad():
        chunked = entropy_from_logits(logits)
    torch.testing.assert_close(bonus.detach(), chunked)
    bonus.sum().backward()
    assert torch.isfinite(with_grad.grad).all() and with_grad.grad.abs().sum() > 0


# ---------------------------------------------------------------- the config


def _config(**algorithm):
    return {"model": {"tiny": {}}, "algorithm": algorithm}


def test_algorithm_defaults():
    algorithm = config_from_dict({"model": {"tiny": {}}}).algorithm
    assert algorithm == GrpoConfig()
    assert algorithm.advantage == "grpo" and algorithm.normalize_std
    assert algorithm.correction == "tis"
    assert algorithm.correction_level == "token"
    assert algorithm.clip_c is None
    assert algorithm.aggregation == "token-mean"
    gae = config_from_dict(_config(advantage="gae")).algorithm
    assert (gae.gamma, gae.lam) == (1.0, 1.0)
    assert (gae.value_clip, gae.value_coef) == (0.2, 0.5)
    assert (algorithm.kl_coef, algorithm.kl_estimator, algorithm.kl_in) == (0.0, "k3", "loss")
    assert algorithm.entropy_coef == 0.0


def test_algorithm_accepts_every_documented_choice():
    for advantage in ADVANTAGES:
        for correction in CORRECTIONS:
            config = config_from_dict(_config(advantage=advantage, correction=correction))
            assert config.algorithm.advantage == advantage
    for mode in AGGREGATIONS:
        assert config_from_dict(_config(aggregation=mode)).algorithm.aggregation == mode
    config = config_from_dict(
        _config(
            clip_c=3.0,
            correction_level="sequence",
            kl_coef=0.01,
            kl_estimator="k2",
            kl_in="reward",
            advantage="gae",
            gamma=0.99,
            lam=0.95,
            value_clip=None,
        )
    )
    assert config.algorithm.clip_c == 3.0 and config.algorithm.value_clip is None


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("clip_c", 1.0, "algorithm.clip_c"),
        ("clip_c", 0.5, "algorithm.clip_c"),
        ("gamma", 1.5, "algorithm.gamma"),
        ("lam", -0.1, "algorithm.lam"),
        ("kl_coef", -1.0, "algorithm.kl_coef"),
        ("entropy_coef", -1.0, "algorithm.entropy_coef"),
        ("value_coef", -1.0, "algorithm.value_coef"),
        ("correction", "vtrace", "algorithm.correction"),
        ("correction_level", "batch", "algorithm.correction_level"),
        ("aggregation", "sum", "algorithm.aggregation"),
        ("kl_estimator", "k4", "algorithm.kl_estimator"),
        ("kl_in", "advantage", "algorithm.kl_in"),
        ("advantage", "ppo", "algorithm.advantage"),
    ],
)
def test_algorithm_rejects_invalid_values(key, value, fragment):
    with pytest.raises(ConfigError) as caught:
        config_from_dict(_config(**{key: value}))
    assert fragment in str(caught.value)


def test_correction_none_with_staleness_warns_naming_both_keys_and_the_risk():
    config = config_from_dict(
        {"model": {"tiny": {}}, "algorithm": {"correction": "none"}, "buffer": {"max_staleness": 2}}
    )
    (warning,) = config_warnings(config)
    assert "algorithm.correction=none" in warning
    assert "buffer.max_staleness=2" in warning
    assert "on-policy" in warning and "collapse" in warning
    assert "algorithm.correction=tis" in warning


def test_no_warning_when_corrected_or_on_policy():
    on_policy = config_from_dict(
        {"model": {"tiny": {}}, "algorithm": {"correction": "none"}, "buffer": {"max_staleness": 0}}
    )
    assert config_warnings(on_policy) == []
    for correction in ("tis", "mis", "decoupled"):
        config = config_from_dict(
            {
                "model": {"tiny": {}},
                "algorithm": {"correction": correction},
                "buffer": {"max_staleness": 4},
            }
        )
        assert config_warnings(config) == [], correction


def test_the_quickstart_config_gets_no_warning_but_an_override_to_none_does():
    quickstart = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
    assert config_warnings(load_config(quickstart)) == []
    overridden = load_config(quickstart, ["algorithm.correction=none"])
    assert len(config_warnings(overridden)) == 1
