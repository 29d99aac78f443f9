"""The RL math: GRPO advantages, the clipped/TIS policy loss and token log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.algorithms import (
    ADVANTAGES,
    grpo_advantages,
    masked_mean,
    policy_loss,
    token_logprobs,
)

torch.set_num_threads(1)


# ------------------------------------------------------------------ advantages


def test_grpo_advantage_of_one_group_is_reward_minus_mean_over_population_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([7, 7, 7, 7])
    # mean = 2/4 = 0.5; population variance = (4 * 0.25) / 4 = 0.25, std = 0.5
    # (1 - 0.5) / 0.5 = 1, (0 - 0.5) / 0.5 = -1
    expected = torch.tensor([1.0, -1.0, -1.0, 1.0])
    advantages = grpo_advantages(rewards, group_ids)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_grpo_is_registered_under_its_config_name():
    assert ADVANTAGES["grpo"] is grpo_advantages


def test_grpo_normalises_interleaved_groups_independently():
    # group 0 at positions 0, 2, 4: rewards 3, 1, 2 -> mean 2, deviations 1, -1, 0
    #   population std = sqrt((1 + 1 + 0) / 3) = sqrt(2/3)
    # group 1 at positions 1, 3: rewards 10, 0 -> mean 5, deviations 5, -5, std 5
    rewards = torch.tensor([3.0, 10.0, 1.0, 0.0, 2.0])
    group_ids = torch.tensor([0, 1, 0, 1, 0])
    s = math.sqrt(2.0 / 3.0)
    expected = torch.tensor([1.0 / s, 5.0 / 5.0, -1.0 / s, -5.0 / 5.0, 0.0])
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
    # group 6: mean 0.5, std 0.5 -> +1, -1
    torch.testing.assert_close(advantages[1:], torch.tensor([1.0, -1.0]), atol=1e-5, rtol=0)


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
