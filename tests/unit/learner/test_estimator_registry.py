"""Contract of the algorithm plug-in points: every registered advantage estimator,
correction, aggregation and KL estimator runs on a small batch with the documented shape
and finite values, the config offers exactly the registered names, and an estimator
registered here (one function plus its config) is taken by the config and the learner
with no other edit."""

from __future__ import annotations

import importlib.util
import typing
from pathlib import Path
from typing import Literal

import pytest
import torch

from asyncrl.config import (
    ADVANTAGE_CONFIGS,
    AlgorithmConfig,
    ConfigError,
    config_from_dict,
    load_config,
    save_config,
)
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    aggregate,
    compute_advantages,
    kl_estimate,
    needs_of,
    policy_loss,
    register_advantage,
)

HERE = Path(__file__).parent / "fixtures" / "make_algorithm_golden.py"
_spec = importlib.util.spec_from_file_location("make_algorithm_golden", HERE)
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

B, T = 4, 5


def small_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool
    )
    logprobs = -torch.rand(B, T, generator=generator) * 2
    return {
        "mask": mask,
        "rewards": torch.tensor([1.0, 0.0, 0.5, 1.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "values": torch.randn(B, T, generator=generator),
        "logprobs": logprobs,
        "other_logprobs": logprobs + torch.randn(B, T, generator=generator),
        "losses": torch.randn(B, T, generator=generator),
    }


# ------------------------------------------------------------------ every entry


@pytest.mark.parametrize("name", list(ADVANTAGES))
def test_every_estimator_gives_finite_token_advantages_zero_where_masked(name):
    x = small_batch()
    estimator = ADVANTAGES[name]
    advantages, returns = compute_advantages(
        name,
        rewards=x["rewards"],
        group_ids=x["group_ids"],
        mask=x["mask"],
        values=x["values"] if estimator.needs_values else None,
        **estimator.knobs_of(estimator.config()),
    )
    assert advantages.shape == (B, T) and advantages.dtype == torch.float32
    assert torch.isfinite(advantages).all()
    assert (advantages[~x["mask"]] == 0).all()
    assert advantages[x["mask"]].abs().sum() > 0  # the batch has signal
    if estimator.needs_values:
        assert returns is not None and returns.shape == (B, T) and torch.isfinite(returns).all()
    else:
        assert returns is None


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_every_correction_weights_each_token_finitely_and_not_negatively(name):
    rho = torch.tensor([[0.0, 0.5, 1.0, 2.0, 5.0]])
    weight = CORRECTIONS[name].weight(rho, 2.0, 0.5)
    assert weight.shape == rho.shape and torch.isfinite(weight).all() and (weight >= 0).all()
    if not CORRECTIONS[name].uses_cap:
        assert torch.equal(weight, CORRECTIONS[name].weight(rho, 100.0, 0.5))
    if not CORRECTIONS[name].uses_floor:
        assert torch.equal(weight, CORRECTIONS[name].weight(rho, 2.0, 0.01))
    x = small_batch()
    logprobs = x["logprobs"].clone().requires_grad_(True)
    loss, stats = policy_loss(
        logprobs, x["logprobs"], x["other_logprobs"], x["values"], x["mask"], correction=name
    )
    loss.backward()
    assert loss.shape == () and torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(value) for value in stats.values())


@pytest.mark.parametrize("name", list(AGGREGATIONS))
def test_every_aggregation_gives_a_finite_scalar_and_ignores_masked_positions(name):
    x = small_batch()
    poisoned = torch.where(x["mask"], x["losses"], torch.full((B, T), float("nan")))
    result = aggregate(poisoned, x["mask"], name)
    assert result.shape == () and torch.isfinite(result)
    assert result == aggregate(x["losses"], x["mask"], name)


@pytest.mark.parametrize("name", list(KL_ESTIMATORS))
def test_every_kl_estimator_is_zero_on_the_reference_and_keeps_its_sign_promise(name):
    x = small_batch()
    same = kl_estimate(x["logprobs"], x["logprobs"], name)
    assert same.shape == (B, T) and (same == 0).all()
    kl = kl_estimate(x["logprobs"], x["other_logprobs"], name)
    assert kl.shape == (B, T) and torch.isfinite(kl).all()
    if KL_ESTIMATORS[name].non_negative:
        assert (kl >= 0).all()
    else:
        assert (kl < 0).any()


def test_the_config_offers_exactly_the_registered_names():
    fields = AlgorithmConfig.model_fields
    assert set(ADVANTAGE_CONFIGS) == set(ADVANTAGES)
    assert set(typing.get_args(fields["correction"].annotation)) == set(CORRECTIONS)
    assert set(typing.get_args(fields["aggregation"].annotation)) == set(AGGREGATIONS)
    assert set(typing.get_args(fields["kl_estimator"].annotation)) == set(KL_ESTIMATORS)


def test_needs_follow_the_registry_not_the_name():
    gae = needs_of(
        config_from_dict({"model": {"tiny": {}}, "algorithm": {"advantage": "gae"}}).algorithm
    )
    assert gae.values and gae.token_rewards and not gae.reference
    kl = {"advantage": "grpo", "kl_coef": 0.1, "kl_in": "reward"}
    grpo = needs_of(config_from_dict({"model": {"tiny": {}}, "algorithm": kl}).algorithm)
    assert not grpo.values and grpo.token_rewards and grpo.reference and grpo.kl_in_reward


# ------------------------------------------------------------------ a new estimator


class ScaledMeanConfig(AlgorithmConfig):
    """Test estimator: the reward minus the batch mean, times ``scale``."""

    advantage: Literal["scaled_mean"] = "scaled_mean"
    scale: float = 1.0


@pytest.fixture
def scaled_mean():
    """Register the test estimator (as a plug-in would), and take it out afterwards."""

    def scaled_mean_advantages(rewards, group_ids, scale):
        return scale * (rewards - rewards.mean())

    register_advantage("scaled_mean", config=ScaledMeanConfig, per_sample=True)(
        scaled_mean_advantages
    )
    yield
    del ADVANTAGES["scaled_mean"], ADVANTAGE_CONFIGS["scaled_mean"]


def test_a_registered_estimator_is_taken_by_the_config_and_saved_with_its_knob(
    scaled_mean, tmp_path
):
    overrides = ["model.tiny={}", "algorithm.advantage=scaled_mean", "algorithm.scale=3"]
    config = load_config(None, overrides)
    assert isinstance(config.algorithm, ScaledMeanConfig) and config.algorithm.scale == 3
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*overrides, "algorithm.gamma=0.9"])
    assert str(caught.value) == (
        "override 'algorithm.gamma=0.9': algorithm.gamma: only used by advantage: "
        "reinforce_pp, gae (this config uses scaled_mean)"
    )
    with pytest.raises(ConfigError, match=r"algorithm\.scale: only used by advantage: scaled_mean"):
        load_config(None, ["model.tiny={}", "algorithm.scale=3"])


def test_a_registered_estimator_drives_the_learner(scaled_mean):
    from asyncrl.generation.tasks import build_tokenizer
    from asyncrl.learner.trainer import Learner

    config = load_config(
        None,
        [
            "model.tiny.num_layers=1",
            "model.tiny.hidden_size=32",
            "model.tiny.intermediate_size=64",
            "algorithm.group_size=4",
            "algorithm.prompts_per_step=4",
            "algorithm.advantage=scaled_mean",
            "algorithm.scale=3",
        ],
    )
    batch = golden.synthetic_batch(0, len(build_tokenizer()))
    with golden.single_rank() as ranks:
        metrics = Learner(config, ranks).train_step(batch)
    per_sample = 3 * (batch.rewards - batch.rewards.mean())
    tokens = batch.loss_mask.sum(-1)
    expected = float((per_sample.abs() * tokens).sum() / tokens.sum())
    assert metrics["advantage_abs_mean"] == pytest.approx(expected, rel=1e-6)
    assert torch.isfinite(torch.tensor(metrics["loss_policy"]))
