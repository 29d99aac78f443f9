"""The policy-loss surrogates (ppo, gspo, cispo, sapo, gmpo, reinforce) against hand-worked
examples: values and gradients w.r.t. the log-probs, their on-policy limits, masking.

The surrogates share one 2x3 example: pi_prox = 0.4 on every token, token ratios r =
pi_theta / pi_prox of [1.5, 1.0, 0.5] (A = 2) and [1.1, 0.7, masked] (A = -1), so five
valid tokens. The sections after them (the on-policy limit, PPO's asymmetric and dual
clips, micro-batches that add up, edge cases) take small examples of their own. Expected
numbers are worked out in the comments (math on plain floats), never by the function
under test.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch

from asyncrl.config import AlgorithmConfig
from asyncrl.learner.algorithms import AGGREGATIONS, CORRECTIONS, POLICY_LOSSES, policy_loss
from tests.helpers.learner import on_policy_inputs

torch.set_num_threads(1)

PROX = 0.4
RATIOS = [[1.5, 1.0, 0.5], [1.1, 0.7, 1.0]]
ADVANTAGES = [2.0, -1.0]
MASK = [[1, 1, 1], [1, 1, 0]]
VALID = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
N = 5  # valid tokens


def _inputs(ratios=RATIOS, behavior_rho=None):
    """(logprobs with grad, proximal, behavior, advantages [B], mask); behavior_rho [B, T]
    sets pi_prox / pi_b (default 1)."""
    proximal = torch.full((2, 3), math.log(PROX))
    logprobs = (proximal + torch.tensor(ratios).log()).requires_grad_(True)
    rho = torch.ones(2, 3) if behavior_rho is None else torch.tensor(behavior_rho)
    behavior = proximal - rho.log()
    return logprobs, proximal, behavior, torch.tensor(ADVANTAGES), torch.tensor(MASK)


def _run(loss: str, aggregation: str = "token-mean", **kwargs):
    logprobs, proximal, behavior, advantages, mask = _inputs(
        behavior_rho=kwargs.pop("behavior_rho", None)
    )
    kwargs.setdefault("correction", "none")
    value, stats = policy_loss(
        logprobs, proximal, behavior, advantages, mask, loss=loss, aggregation=aggregation, **kwargs
    )
    value.backward()
    return value.item(), logprobs.grad, stats


def _grad(entries: dict[tuple[int, int], float]) -> torch.Tensor:
    grad = torch.zeros(2, 3)
    for position, value in entries.items():
        grad[position] = value
    return grad


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ------------------------------------------------------------------ registry


def test_the_registered_losses_are_exactly_the_configs_choices():
    choices = typing.get_args(AlgorithmConfig.model_fields["policy_loss"].annotation)
    assert sorted(POLICY_LOSSES) == sorted(choices)


def test_an_unknown_loss_is_refused_naming_the_known_ones():
    logprobs, proximal, behavior, advantages, mask = _inputs()
    with pytest.raises(ValueError, match="gspo"):
        policy_loss(logprobs, proximal, behavior, advantages, mask, loss="grpo")


def test_a_knob_no_loss_reads_is_refused_by_name():
    logprobs, proximal, behavior, advantages, mask = _inputs()
    with pytest.raises(TypeError, match="clip_lo"):
        policy_loss(logprobs, proximal, behavior, advantages, mask, clip_lo=0.1)


@pytest.mark.parametrize("loss", ["gspo", "cispo", "sapo", "gmpo", "reinforce"])
def test_the_dual_clip_is_refused_by_the_losses_without_one(loss):
    logprobs, proximal, behavior, advantages, mask = _inputs()
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(logprobs, proximal, behavior, advantages, mask, loss=loss, clip_c=3.0)


# ------------------------------------------------------------------ hand-worked 2x3


def test_ppo_clips_per_token():
    value, grad, stats = _run("ppo")
    # row 0, A = 2: r 1.5 -> min(3, 2.4) = 2.4 clipped; r 1 -> 2; r 0.5 -> min(1, 1.6) = 1
    # row 1, A = -1: r 1.1 -> -1.1 inside; r 0.7 -> min(-0.7, -0.8) = -0.8 clipped
    assert value == pytest.approx(-(2.4 + 2.0 + 1.0 - 1.1 - 0.8) / N, abs=1e-6)
    # d(-r A)/dlogp = -r A on unclipped tokens, over N
    expected = _grad({(0, 1): -2.0 / N, (0, 2): -1.0 / N, (1, 0): 1.1 / N})
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert stats["clip_frac"].item() == pytest.approx(2 / N)


def test_gspo_uses_one_sequence_ratio_on_every_token():
    value, grad, stats = _run("gspo")
    s0 = (1.5 * 1.0 * 0.5) ** (1 / 3)  # 0.9086, inside [0.8, 1.2]
    s1 = (1.1 * 0.7) ** (1 / 2)  # 0.8775, inside
    # every token of row i: -s_i A_i; token-mean over 5
    assert value == pytest.approx((-3 * 2.0 * s0 + 2 * 1.0 * s1) / N, abs=1e-6)
    # token-level gradient: d(-A sg(s) pi/sg(pi))/dlogp = -A s
    expected = _grad(
        {**dict.fromkeys(VALID[:3], -2.0 * s0 / N), **dict.fromkeys(VALID[3:], s1 / N)}
    )
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert stats["clip_frac"].item() == 0.0


def test_gspo_with_verls_seq_mean_token_mean_is_the_papers_sequence_objective():
    value, grad, _ = _run("gspo", "seq-mean-token-mean")
    s0, s1 = (0.75) ** (1 / 3), (0.77) ** (1 / 2)
    # J = (1/G) sum_i s_i A_i, G = 2; grad of token t: -(1/G) (1/|y_i|) s_i A_i
    assert value == pytest.approx(-(s0 * 2.0 + s1 * -1.0) / 2, abs=1e-6)
    expected = _grad(
        {**dict.fromkeys(VALID[:3], -2.0 * s0 / 6), **dict.fromkeys(VALID[3:], s1 / 4)}
    )
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_gspo_clips_the_whole_sequence_even_its_on_policy_token():
    logprobs, proximal, behavior, advantages, mask = _inputs([[2.0, 1.0, 1.5], [1.1, 0.7, 1.0]])
    value, stats = policy_loss(
        logprobs, proximal, behavior, advantages, mask, loss="gspo", correction="none"
    )
    value.backward()
    # s0 = 3^(1/3) = 1.442 > 1.2 with A > 0: min(s A, 1.2 A) = 2.4 on all three tokens
    s1 = 0.77**0.5
    assert value.item() == pytest.approx((-3 * 2.4 + 2 * s1) / N, abs=1e-6)
    expected = _grad(dict.fromkeys(VALID[3:], s1 / N))
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=0)
    assert stats["clip_frac"].item() == pytest.approx(3 / N)


def test_cispo_clips_a_stop_gradient_weight_and_keeps_every_gradient():
    value, grad, stats = _run("cispo")
    # clipped weights c: [1.2, 1.0, 0.8] (A = 2) and [1.1, 0.8] (A = -1)
    c = {VALID[0]: 1.2, VALID[1]: 1.0, VALID[2]: 0.8, VALID[3]: 1.1, VALID[4]: 0.8}
    a = {p: ADVANTAGES[p[0]] for p in VALID}
    logp = {p: math.log(PROX * RATIOS[p[0]][p[1]]) for p in VALID}
    assert value == pytest.approx(-sum(c[p] * a[p] * logp[p] for p in VALID) / N, abs=1e-6)
    expected = _grad({p: -c[p] * a[p] / N for p in VALID})
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    # the weight of r = 1.5, 0.5 and 0.7 was truncated (verl's cispo pg_clipfrac)
    assert stats["clip_frac"].item() == pytest.approx(3 / N)


def test_sapo_replaces_the_clip_by_a_soft_gate_per_advantage_sign():
    value, grad, stats = _run("sapo", sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    expected_value, entries = 0.0, {}
    for p in VALID:
        r, a = RATIOS[p[0]][p[1]], ADVANTAGES[p[0]]
        tau = 1.0 if a > 0 else 2.0
        sig = _sigmoid(tau * (r - 1.0))
        expected_value += -sig * 4.0 / tau * a / N
        # d/dlogp [sigma(tau (r - 1)) 4 / tau] = 4 sigma (1 - sigma) r
        entries[p] = -a * 4.0 * sig * (1.0 - sig) * r / N
    assert value == pytest.approx(expected_value, abs=1e-6)
    torch.testing.assert_close(grad, _grad(entries), atol=1e-6, rtol=0)
    assert stats["clip_frac"].item() == 0.0


def test_gmpo_takes_the_geometric_mean_of_log_clipped_token_ratios():
    value, grad, stats = _run("gmpo", "seq-mean-token-mean")
    # row 0 (A > 0): log r = [log 1.5, 0, log 0.5]; the clip caps only the growth side,
    # so log 1.5 -> 0.2 (no gradient) and log 0.5 stays
    g0 = math.exp((0.2 + 0.0 + math.log(0.5)) / 3)
    # row 1 (A < 0): log r = [log 1.1, log 0.7]; log 0.7 < -0.2 -> -0.2 (no gradient)
    g1 = math.exp((math.log(1.1) - 0.2) / 2)
    # verl's geo_mean: mean over sequences of -A_i g_i
    assert value == pytest.approx((-2.0 * g0 + 1.0 * g1) / 2, abs=1e-6)
    # d/dlogp_t of -A g / G = -A g (1/|y|) / G on the tokens the clip kept
    expected = _grad({(0, 1): -2.0 * g0 / 6, (0, 2): -2.0 * g0 / 6, (1, 0): g1 / 4})
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)
    assert stats["clip_frac"].item() == pytest.approx(2 / N)


def test_gmpo_under_token_mean_weights_each_sequence_by_its_length():
    value, grad, _ = _run("gmpo")
    g0 = math.exp((0.2 + math.log(0.5)) / 3)
    g1 = math.exp((math.log(1.1) - 0.2) / 2)
    # the sequence's loss sits on each of its tokens: (3 L_0 + 2 L_1) / 5
    assert value == pytest.approx((3 * -2.0 * g0 + 2 * g1) / N, abs=1e-6)
    expected = _grad({(0, 1): -2.0 * g0 / N, (0, 2): -2.0 * g0 / N, (1, 0): g1 / N})
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_gmpo_weights_a_sequence_by_the_geometric_mean_of_its_behavior_weights():
    # tis weights: row 0 [1, 4 -> 2, 0.5] has geometric mean 1; row 1 [2, 2] has 2
    rho = [[1.0, 4.0, 0.5], [2.0, 2.0, 1.0]]
    plain, plain_grad, _ = _run("gmpo", "seq-mean-token-mean")
    value, grad, _ = _run("gmpo", "seq-mean-token-mean", correction="tis", behavior_rho=rho)
    g0 = math.exp((0.2 + math.log(0.5)) / 3)
    g1 = math.exp((math.log(1.1) - 0.2) / 2)
    assert value == pytest.approx((-2.0 * g0 * 1.0 + 1.0 * g1 * 2.0) / 2, abs=1e-5)
    torch.testing.assert_close(grad[0], plain_grad[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(grad[1], 2.0 * plain_grad[1], atol=1e-6, rtol=0)
    assert plain == pytest.approx((-2.0 * g0 + g1) / 2, abs=1e-6)


def test_reinforce_is_minus_weighted_advantage_times_logprob():
    rho = [[4.0, 1.0, 1.0], [1.0, 0.5, 1.0]]  # tis: w = [2, 1, 1], [1, 0.5]
    value, grad, stats = _run("reinforce", correction="tis", behavior_rho=rho)
    w = {VALID[0]: 2.0, VALID[1]: 1.0, VALID[2]: 1.0, VALID[3]: 1.0, VALID[4]: 0.5}
    a = {p: ADVANTAGES[p[0]] for p in VALID}
    logp = {p: math.log(PROX * RATIOS[p[0]][p[1]]) for p in VALID}
    assert value == pytest.approx(-sum(w[p] * a[p] * logp[p] for p in VALID) / N, abs=1e-6)
    torch.testing.assert_close(grad, _grad({p: -w[p] * a[p] / N for p in VALID}), atol=1e-6, rtol=0)
    assert stats["clip_frac"].item() == 0.0


# ------------------------------------------------------------------ limits


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"])
def test_on_policy_every_loss_has_the_policy_gradient_minus_w_a(loss, aggregation):
    # r = 1 everywhere; a sequence-level weight w = [2, 0.5] per row (tis, cap 4)
    ratios = [[1.0] * 3, [1.0] * 3]
    logprobs, proximal, _, advantages, mask = _inputs(ratios)
    behavior = proximal - torch.tensor([[math.log(2.0)], [math.log(0.5)]])
    value, _ = policy_loss(
        logprobs,
        proximal,
        behavior,
        advantages,
        mask,
        loss=loss,
        aggregation=aggregation,
        correction="tis",
        correction_level="geometric",
        correction_cap=4.0,
    )
    value.backward()
    w, lengths = [2.0, 0.5], [3, 2]
    per_token = {
        p: -w[p[0]] * ADVANTAGES[p[0]] / (N if aggregation == "token-mean" else 2 * lengths[p[0]])
        for p in VALID
    }
    torch.testing.assert_close(logprobs.grad, _grad(per_token), atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "gmpo"])
def test_on_policy_the_ratio_losses_are_minus_the_mean_advantage(loss):
    logprobs, proximal, behavior, advantages, mask = _inputs([[1.0] * 3, [1.0] * 3])
    value, _ = policy_loss(logprobs, proximal, behavior, advantages, mask, loss=loss)
    assert value.item() == pytest.approx(-(3 * 2.0 - 2 * 1.0) / N, abs=1e-6)


def test_on_policy_sapo_is_two_over_tau_times_minus_the_advantage():
    logprobs, proximal, behavior, advantages, mask = _inputs([[1.0] * 3, [1.0] * 3])
    value, _ = policy_loss(
        logprobs, proximal, behavior, advantages, mask, loss="sapo", sapo_tau_neg=2.0
    )
    # gate(1) = sigmoid(0) 4 / tau = 2 / tau: -(3 * 2 * 2/1 - 2 * 1 * 2/2) / 5
    assert value.item() == pytest.approx(-(3 * 2.0 * 2.0 - 2 * 1.0 * 1.0) / N, abs=1e-6)


def test_cispo_with_an_unbounded_clip_is_reinforce_weighted_by_the_ratio():
    _, cispo_grad, stats = _run("cispo", clip_low=1.0, clip_high=100.0)
    # gradient -r A / N: the plain importance-sampled policy gradient
    expected = _grad({p: -RATIOS[p[0]][p[1]] * ADVANTAGES[p[0]] / N for p in VALID})
    torch.testing.assert_close(cispo_grad, expected, atol=1e-6, rtol=0)
    assert stats["clip_frac"].item() == 0.0


def test_gmpo_of_a_one_token_sequence_inside_the_clip_is_ppo():
    logprobs = torch.tensor([[math.log(1.1)]], requires_grad=True)
    zeros, one = torch.zeros(1, 1), torch.ones(1, 1)
    gmpo, _ = policy_loss(logprobs, zeros, zeros, torch.tensor([3.0]), one, loss="gmpo")
    gmpo.backward()
    # exp(log 1.1) * 3 = 3.3, gradient -3.3, as PPO inside its clip
    assert gmpo.item() == pytest.approx(-3.3, abs=1e-6)
    assert logprobs.grad.item() == pytest.approx(-3.3, abs=1e-6)


# ------------------------------------------------------------------ masking, scale, knobs


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"])
def test_nan_at_masked_positions_changes_nothing(loss, aggregation):
    results = []
    for fill in (0.0, math.nan):
        logprobs, proximal, behavior, advantages, mask = _inputs()
        advantages = advantages.unsqueeze(-1).expand(2, 3).clone()
        leaf = logprobs.detach().clone()
        for tensor in (leaf, proximal, behavior, advantages):
            tensor[1, 2] = fill
        leaf.requires_grad_(True)
        value, stats = policy_loss(
            leaf, proximal, behavior, advantages, mask, loss=loss, aggregation=aggregation
        )
        value.backward()
        results.append((value.detach(), leaf.grad, stats))
    (v0, g0, s0), (v1, g1, s1) = results
    assert torch.isfinite(v1) and torch.equal(v0, v1)
    assert torch.equal(g0, g1) and g1[1, 2].item() == 0.0
    assert all(torch.equal(s0[key], s1[key]) for key in s0)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"])
@pytest.mark.parametrize("scale", [2.0, torch.tensor(2.0)])
def test_weight_scale_divides_the_behavior_weight(loss, scale):
    value, grad, stats = _run(loss, correction="tis")
    scaled, scaled_grad, scaled_stats = _run(loss, correction="tis", weight_scale=scale)
    assert scaled == pytest.approx(value / 2, abs=1e-6)
    torch.testing.assert_close(scaled_grad, grad / 2, atol=1e-7, rtol=0)
    applied = scaled_stats["importance_applied_mean"].item()
    assert applied == pytest.approx(stats["importance_applied_mean"].item() / 2)


def test_correction_floor_reaches_the_behavior_weights():
    # icepop drops rho outside [floor, cap]; rho = 0.3 on (0, 0): dropped under the default
    # floor 1 / cap = 0.5, kept (w = 0.3) under floor 0.2
    rho = [[0.3, 1.0, 1.0], [1.0, 1.0, 1.0]]
    _, default_grad, _ = _run("reinforce", correction="icepop", behavior_rho=rho)
    _, floor_grad, _ = _run(
        "reinforce", correction="icepop", behavior_rho=rho, correction_floor=0.2
    )
    assert default_grad[0, 0].item() == 0.0
    assert floor_grad[0, 0].item() == pytest.approx(-0.3 * 2.0 / N, abs=1e-6)


@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_sequence_losses_split_into_micro_batches_sum_to_the_full_batch(loss):
    full, full_grad, _ = _run(loss, "seq-mean-token-mean")
    logprobs, proximal, behavior, advantages, mask = _inputs()
    total = sum(
        policy_loss(
            logprobs[rows],
            proximal[rows],
            behavior[rows],
            advantages[rows],
            mask[rows],
            loss=loss,
            correction="none",
            aggregation="seq-mean-token-mean",
            num_sequences=2.0,
        )[0]
        for rows in (slice(0, 1), slice(1, 2))
    )
    total.backward()
    assert total.item() == pytest.approx(full, abs=1e-6)
    torch.testing.assert_close(logprobs.grad, full_grad, atol=1e-7, rtol=0)


# ---------------------------------- on-policy, clipping, behavior weight


def test_on_policy_loss_is_minus_the_mean_advantage_over_masked_tokens():
    logprobs, proximal, behavior, advantages, mask = on_policy_inputs()
    loss, _ = policy_loss(logprobs, proximal, behavior, advantages, mask)
    # masked tokens: two of sample 0 (A = 2) and one of sample 1 (A = -0.5)
    # loss = -(2 + 2 - 0.5) / 3 = -3.5 / 3
    assert loss.item() == pytest.approx(-3.5 / 3, abs=1e-6)


def test_on_policy_gradient_is_minus_advantage_over_token_count_on_masked_tokens():
    logprobs, proximal, behavior, advantages, mask = on_policy_inputs()
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
    logprobs, proximal, _, advantages, mask = on_policy_inputs()
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
    logprobs, proximal, _, advantages, mask = on_policy_inputs()
    # raw weight exp(log 1.5) = 1.5 < cap 2
    behavior = proximal - math.log(1.5)
    loss, stats = policy_loss(logprobs, proximal, behavior, advantages, mask)
    assert loss.item() == pytest.approx(1.5 * -3.5 / 3, abs=1e-5)
    assert stats["importance_truncated_frac"].item() == 0.0


def test_correction_none_ignores_the_behavior_logprobs():
    logprobs, proximal, _, advantages, mask = on_policy_inputs()
    far_behavior = proximal - 5.0
    loss, stats = policy_loss(logprobs, proximal, far_behavior, advantages, mask, correction="none")
    assert loss.item() == pytest.approx(-3.5 / 3, abs=1e-6)
    # the raw weight is still reported, e^5, but not applied
    assert stats["importance_weight_mean"].item() == pytest.approx(math.exp(5.0), rel=1e-5)


def test_masked_tokens_contribute_nothing_whatever_their_values():
    logprobs, proximal, behavior, advantages, mask = on_policy_inputs()
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
    logprobs, proximal, behavior, advantages, _ = on_policy_inputs()
    mask = torch.zeros(2, 3)
    loss, stats = policy_loss(logprobs, proximal, behavior, advantages, mask)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(logprobs.grad).all()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    for name, value in stats.items():
        assert torch.isfinite(value).all(), name


def test_an_unknown_correction_raises_value_error():
    logprobs, proximal, behavior, advantages, mask = on_policy_inputs()
    with pytest.raises(ValueError, match="unknown correction"):
        policy_loss(logprobs, proximal, behavior, advantages, mask, correction="vtrace")


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


# ------------------------------------------ micro-batches add up exactly


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


# -------------------------------------------------------------- clipping


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
    logprobs, proximal, behavior, advantages, mask = on_policy_inputs()
    per_sample, _ = policy_loss(logprobs, proximal, behavior, advantages, mask)
    per_token, _ = policy_loss(
        logprobs, proximal, behavior, advantages.unsqueeze(-1).expand(2, 3), mask
    )
    assert per_token.item() == per_sample.item()


# ------------------------------------------------------------ edge cases


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


def test_ppo_kl_stat_is_zero_on_policy_and_positive_off_policy():
    logprobs, proximal, behavior, advantages, mask = on_policy_inputs()
    _, stats = policy_loss(logprobs, proximal, behavior, advantages, mask)
    assert stats["ppo_kl"].item() == pytest.approx(0.0, abs=1e-7)
    # one token, ratio 2: k3 = (r - 1) - log r = 1 - log 2
    _, _, stats = _one_token_loss(2.0, 1.0)
    assert stats["ppo_kl"].item() == pytest.approx(1 - math.log(2.0), abs=1e-6)
