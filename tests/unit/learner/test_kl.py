"""KL to the reference (each estimator on a hand-worked token, k3's clamps, abs, the KL in
the reward) and the in-reward KL coefficient's controllers, against hand-worked values and
gradients (verl's ``kl_penalty_forward`` and ``AdaptiveKLController``)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    batch_kl,
    compute_advantages,
    kl_estimate,
    make_kl_controller,
    token_level_rewards,
)
from tests.helpers.tensors import close

torch.set_num_threads(1)


def _value_and_grad(x: float, estimator: str) -> tuple[float, float]:
    """The estimate at log-ratio ``x`` (reference log-prob 0) and its derivative in x."""
    logprobs = torch.tensor([[x]], requires_grad=True)
    kl = kl_estimate(logprobs, torch.zeros(1, 1), estimator)
    kl.sum().backward()
    return kl.item(), logprobs.grad.item()


# ------------------------------------------------------------------------- k3


@pytest.mark.parametrize("x", [-2.0, -1.0, -0.25, math.log(2.0), 1.0, 5.0, 10.5])
def test_k3_inside_the_clamps_is_exp_minus_x_minus_one_plus_x_with_its_gradient(x):
    # k3(x) = exp(-x) - 1 + x, d/dx = 1 - exp(-x); every x here has k3 below the cap 10
    # (k3(-2) = e^2 - 3 = 4.39, k3(10.5) = 9.50003)
    value, grad = _value_and_grad(x, "k3")
    assert value == pytest.approx(math.exp(-x) - 1 + x, rel=1e-5, abs=1e-6)
    assert grad == pytest.approx(1 - math.exp(-x), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("x", [-25.0, -1000.0, 25.0, 1000.0])
def test_k3_past_the_log_ratio_clamp_is_flat_with_no_gradient(x):
    # |x| > 20: x is clamped to +-20 in both terms: k3(-20) = e^20 - 21 and k3(20) = 19,
    # both above the cap of 10, so 10 with gradient 0 (verl). Before the fix, x = -25 had
    # gradient +1 (the linear term alone), pushing x further down; x = 25 had 1 - e^-25.
    value, grad = _value_and_grad(x, "k3")
    assert value == 10.0
    assert grad == 0.0


@pytest.mark.parametrize("x", [-3.0, -15.0, 12.0])
def test_k3_above_the_cap_of_ten_has_no_gradient(x):
    # inside the +-20 clamp but k3 above 10 (verl's low_var_kl clamps the estimate to 10):
    # k3(-3) = e^3 - 4 = 16.09, k3(-15) = e^15 - 16, k3(12) = 11.000006
    value, grad = _value_and_grad(x, "k3")
    assert value == 10.0
    assert grad == 0.0


def test_k3_is_finite_with_a_reference_of_minus_infinity_far_away():
    logprobs = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1e30, 1e30]])
    kl = kl_estimate(logprobs, ref, "k3")
    kl.sum().backward()
    assert torch.equal(kl.detach(), torch.full((1, 2), 10.0))
    assert torch.equal(logprobs.grad, torch.zeros(1, 2))


# ------------------------------------------------------------------------ abs


@pytest.mark.parametrize(("x", "value", "grad"), [(-0.75, 0.75, -1.0), (2.5, 2.5, 1.0)])
def test_abs_is_the_absolute_log_ratio(x, value, grad):
    got_value, got_grad = _value_and_grad(x, "abs")
    assert got_value == pytest.approx(value, abs=1e-7)
    assert got_grad == grad


def test_abs_and_k3_are_registered_with_their_properties():
    assert (KL_ESTIMATORS["abs"].non_negative, KL_ESTIMATORS["abs"].unbiased) == (True, False)
    assert (KL_ESTIMATORS["k3"].non_negative, KL_ESTIMATORS["k3"].unbiased) == (True, True)


# ------------------------------------------------------------ KL controllers


def test_the_adaptive_controller_over_three_hand_worked_updates():
    controller = AdaptiveKLController(kl_coef=0.1, target=0.1, horizon=100)
    # kl 0.15: error 0.15 / 0.1 - 1 = 0.5, clipped to 0.2: 0.1 * (1 + 0.2 * 10 / 100) = 0.102
    controller.update(0.15, n_samples=10)
    assert controller.value == pytest.approx(0.102, rel=1e-12)
    # kl 0.09: error -0.1 (inside the clip): 0.102 * (1 - 0.1 * 20 / 100) = 0.09996
    controller.update(0.09, n_samples=20)
    assert controller.value == pytest.approx(0.09996, rel=1e-12)
    # kl 0: error -1, clipped to -0.2: 0.09996 * (1 - 0.2 * 50 / 100) = 0.089964
    controller.update(0.0, n_samples=50)
    assert controller.value == pytest.approx(0.089964, rel=1e-12)


def test_the_adaptive_controller_resumes_from_its_state_dict():
    controller = AdaptiveKLController(kl_coef=0.1, target=0.1, horizon=100)
    controller.update(0.15, n_samples=10)  # 0.102
    state = controller.state_dict()
    assert state == {"value": pytest.approx(0.102)}
    resumed = AdaptiveKLController(kl_coef=0.5, target=0.1, horizon=100)
    resumed.load_state_dict(state)
    assert resumed.value == controller.value
    # and steers on from there: 0.102 * 1.02
    resumed.update(1.0, n_samples=10)
    assert resumed.value == pytest.approx(0.102 * 1.02, rel=1e-12)


def test_the_fixed_controller_never_moves_and_keeps_its_configured_value():
    controller = FixedKLController(0.05)
    controller.update(10.0, n_samples=1000)
    assert controller.value == 0.05
    assert controller.state_dict() == {"value": 0.05}
    controller.load_state_dict({"value": 0.7})
    assert controller.value == 0.05


def test_make_kl_controller_builds_each_kind_and_rejects_others():
    fixed = make_kl_controller("fixed", kl_coef=0.2)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.2
    adaptive = make_kl_controller("adaptive", kl_coef=0.2, target=0.05, horizon=500)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.2, 0.05, 500)
    with pytest.raises(ValueError, match="unknown KL controller"):
        make_kl_controller("pid", kl_coef=0.2)
    with pytest.raises(ValueError, match="positive"):
        make_kl_controller("adaptive", kl_coef=0.2, horizon=0)


def test_batch_kl_averages_each_rows_token_mean_over_all_rows():
    kl = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # row means 1.5, 4, 0 (no valid token); over 3 rows: 5.5 / 3 (verl's apply_kl_penalty)
    assert batch_kl(kl, mask) == pytest.approx(5.5 / 3, rel=1e-6)


# -------------------------------------- estimators on hand-worked tokens


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
