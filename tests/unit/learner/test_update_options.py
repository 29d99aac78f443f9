"""Every policy loss, correction and KL option reaches a real learner step.

The math of each option is checked by hand-worked examples beside it (test_policy_losses,
test_corrections, test_rejection, test_kl, ...); here a single-rank learner (FSDP2 over a
process group of one) trains the tiny model through ``Learner.train_step`` with the option
set, and the step shows that the option took effect: its metrics, what it masked, and
what the update needed of the pre-pass.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.learner import checkpoint
from asyncrl.learner.algorithms import off_policy
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.policy import Learner
from tests.helpers.learner import TINY_LEARNER, synthetic_batch


def make_learner(ranks: Ranks, *overrides: str) -> Learner:
    config = load_config(None, [*TINY_LEARNER, *overrides])
    torch.manual_seed(config.run.seed)
    return Learner(config, ranks)


def batch_at(step: int):
    return synthetic_batch(step, len(build_tokenizer()))


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in learner.full_tensors()}


def changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"])
def test_every_policy_loss_trains_the_policy(ranks: Ranks, loss: str):
    learner = make_learner(ranks, f"algorithm.policy_loss={loss}")
    before = weights(learner)
    metrics = learner.train_step(batch_at(0))
    assert math.isfinite(metrics["loss_policy"])
    assert metrics["learner_skipped_nonfinite_total"] == 0
    assert changed(before, weights(learner))


def test_sequence_losses_default_to_verl_s_aggregation(ranks: Ranks):
    learner = make_learner(ranks, "algorithm.policy_loss=gspo")
    assert learner.config.algorithm.aggregation == "seq-mean-token-mean"


def test_every_step_reports_verl_s_off_policy_metrics(ranks: Ranks):
    metrics = make_learner(ranks).train_step(batch_at(0))
    keys = set(off_policy.TOKEN_MEAN_KEYS) | set(off_policy.SEQUENCE_MEAN_KEYS)
    assert keys <= set(metrics)
    assert all(math.isfinite(metrics[key]) for key in keys)
    # the synthetic behavior log-probs are far from the tiny model's: clearly off-policy
    assert metrics["offpolicy_kl_k3"] > 0.1
    assert 0 < metrics["offpolicy_ess"] <= 1


def test_bypass_trains_against_the_behavior_policy_without_a_pre_pass(ranks: Ranks):
    learner = make_learner(ranks, "algorithm.bypass=true", "learner.minibatches=2")
    batch = batch_at(0)
    assert learner.proximal_logprobs(batch) == {}  # two updates, yet no proximal pass
    metrics = learner.train_step(batch)
    assert metrics["importance_weight_mean"] == pytest.approx(1.0)
    # the PPO ratio is pi_theta / pi_b, far from 1 here: the clip acts on the first update
    assert metrics["learner_clip_frac"] > 0
    plain = make_learner(ranks, "learner.minibatches=2").train_step(batch)
    assert plain["importance_weight_mean"] != pytest.approx(1.0)


def test_rejection_sampling_drops_what_a_criterion_refuses(ranks: Ranks):
    everything = "algorithm.rejection=[{statistic: token, estimator: ratio, high: 0.0}]"
    learner = make_learner(ranks, everything)
    batch = batch_at(0)
    assert "proximal" in learner.proximal_logprobs(batch)  # a whole-batch correction
    before = weights(learner)
    metrics = learner.train_step(batch)
    assert metrics["rejection_token_frac"] == 1.0
    assert metrics["rejection_seq_frac"] == 1.0
    assert metrics["loss_policy"] == 0.0
    assert not changed(before, weights(learner))  # nothing left to train on

    lenient = "algorithm.rejection=[{statistic: seq_max, estimator: k3, high: 1.0e6}]"
    metrics = make_learner(ranks, lenient).train_step(batch)
    assert metrics["rejection_token_frac"] == 0.0


def test_m2po_masks_until_the_second_moment_is_under_the_threshold(ranks: Ranks):
    metrics = make_learner(ranks, "algorithm.m2po_threshold=0.04").train_step(batch_at(0))
    assert metrics["m2po_second_moment_before"] > 0.04  # the synthetic batch is far off-policy
    assert metrics["m2po_second_moment_after"] <= 0.04
    assert 0 < metrics["m2po_masked_frac"] < 1


def test_batch_normalised_weights_average_one(ranks: Ranks):
    learner = make_learner(
        ranks, "algorithm.correction_batch_normalize=true", "algorithm.correction=icepop"
    )
    metrics = learner.train_step(batch_at(0))
    assert metrics["importance_batch_scale"] != pytest.approx(1.0)
    assert metrics["importance_applied_mean"] == pytest.approx(1.0, rel=1e-4)


def test_the_adaptive_kl_coefficient_moves_and_is_checkpointed(ranks: Ranks, tmp_path):
    adaptive = [
        "algorithm.kl_coef=0.05",
        "algorithm.kl_in=reward",
        "algorithm.kl_controller=adaptive",
        "algorithm.kl_target=1.0e-6",
        "algorithm.kl_horizon=16",
    ]
    learner = make_learner(ranks, *adaptive)
    first = learner.train_step(batch_at(0))
    second = learner.train_step(batch_at(1))
    # step 0: the policy is the reference, KL 0 < target: the coefficient shrinks by the
    # largest step, 1 - 0.2 * 16 / 16; step 1: the policy moved, KL > target: it grows
    assert first["kl_coef"] == pytest.approx(0.05)
    assert first["kl_reward"] == 0.0
    assert second["kl_coef"] == pytest.approx(0.05 * 0.8)
    assert second["kl_reward"] > 1e-6
    assert learner.update.kl_control.value == pytest.approx(0.05 * 0.8 * 1.2)

    assert learner.save_checkpoint(tmp_path / "ckpt")
    checkpoint.mark_complete(tmp_path / "ckpt")
    resumed = make_learner(ranks, *adaptive)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.update.kl_control.value == pytest.approx(0.05 * 0.8 * 1.2)


def test_the_abs_kl_estimator_is_reported_in_the_loss(ranks: Ranks):
    learner = make_learner(ranks, "algorithm.kl_coef=0.1", "algorithm.kl_estimator=abs")
    learner.train_step(batch_at(0))
    metrics = learner.train_step(batch_at(1))  # the policy moved from the reference
    assert metrics["learner_kl"] > 0


def test_a_tied_lm_head_is_published_once_and_the_engine_ties_it_back(ranks: Ranks):
    from asyncrl.config import GeneratorsConfig
    from asyncrl.generation.models import build_policy
    from asyncrl.generators.hf_backend import HFBackend

    learner = make_learner(ranks)
    full = weights(learner)
    published = {name: tensor.clone() for name, tensor in learner.published_tensors()}
    assert set(full) - set(published) == {"lm_head.weight"}  # the tiny model ties it
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    model, tokenizer = build_policy(learner.config.model, seed=99)  # other weights
    backend = HFBackend(model, tokenizer, GeneratorsConfig())
    backend.load_weights(published, 1)
    held = model.state_dict()
    assert all(torch.equal(held[name], tensor) for name, tensor in full.items())
