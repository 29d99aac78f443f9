"""One bad batch does not poison the run: a non-finite update is skipped, and a learner
whose weights or optimizer state are not finite writes no complete checkpoint.

A real single-rank learner (FSDP2 over a process group of one, in this process)
trains the tiny model on small synthetic batches through ``Learner.train_step``.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.core.paths import COMPLETE, checkpoint_dir, latest_checkpoint
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.learner import checkpoint
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.checkpointer import Checkpointer, Completer
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.policy import Learner
from tests.helpers.learner import TINY_LEARNER, synthetic_batch


@pytest.fixture
def learner(ranks: Ranks) -> Learner:
    config = load_config(None, TINY_LEARNER)
    torch.manual_seed(config.run.seed)
    return Learner(config, ranks)


def batch_at(step: int) -> TrainBatch:
    return synthetic_batch(step, len(build_tokenizer()))


def weights(learner: Learner) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in learner.full_tensors()}


def all_finite(state: dict[str, torch.Tensor]) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in state.values())


@pytest.mark.parametrize("bad_reward", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_batch_with_a_non_finite_reward_changes_no_weight_and_is_counted(
    learner: Learner, bad_reward: float, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncrl.learner")
    learner.train_step(batch_at(0))  # the optimizer has state to poison
    before = weights(learner)
    batch = batch_at(1)
    batch.rewards[5] = bad_reward  # one forged sample: its group's advantages are not finite

    metrics = learner.train_step(batch)

    after = weights(learner)
    assert all(torch.equal(after[name], before[name]) for name in before), "weights moved"
    assert metrics["learner_skipped_nonfinite_total"] == 1
    assert all(p.grad is None for p in learner.model.parameters()), "gradients were kept"
    assert checkpoint.nonfinite_state(learner.model, learner.optimizer) == ([], 0)
    assert learner.version == 2  # the batch was consumed: the version moves on as usual
    (warning,) = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert warning.startswith("step 1 (mini-batch 1 of 1): ")
    assert "update skipped" in warning

    metrics = learner.train_step(batch_at(2))  # the next good batch trains as usual
    assert metrics["learner_skipped_nonfinite_total"] == 1
    trained = weights(learner)
    assert all_finite(trained)
    assert any(not torch.equal(trained[name], before[name]) for name in before)


def poison(learner: Learner, where: str) -> None:
    """A NaN in the first local shard of a parameter, or of its Adam moment."""
    parameter = next(learner.model.parameters())
    tensor = parameter if where == "parameter" else learner.optimizer.state[parameter]["exp_avg"]
    with torch.no_grad():
        tensor.to_local().view(-1)[0] = math.nan


@pytest.mark.parametrize("where", ["parameter", "optimizer state"])
def test_a_checkpoint_of_a_non_finite_learner_is_never_marked_complete(
    tmp_path, learner: Learner, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncrl.learner")
    learner.train_step(batch_at(0))
    buffer_saves: list[int] = []
    buffer = SimpleNamespace(save_state=lambda step, timeout_s=None: buffer_saves.append(step))
    checkpointer = Checkpointer(learner, tmp_path, Completer(buffer, tmp_path, keep=None))
    checkpointer.save()  # a good one first: step 1
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)

    learner.train_step(batch_at(1))
    poison(learner, where)
    checkpointer.save()

    refused = checkpoint_dir(tmp_path, 2)
    assert not (refused / COMPLETE).exists()
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 1)
    assert buffer_saves == [1]  # the buffer was not asked for its part of step 2
    assert learner.checkpoints_refused == 1
    assert "checkpoint step-000002 refused" in caplog.text
    with pytest.raises(RuntimeError, match="not marking it complete"):
        checkpoint.mark_complete(refused)
    metrics = learner.train_step(batch_at(2))
    assert metrics["learner_checkpoints_refused_total"] == 1
