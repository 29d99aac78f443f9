"""``learner.keep_checkpoints: N`` keeps the newest N complete checkpoints, and nothing else
that a resume could need or that is still being written is ever deleted."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from asyncrl.config import load_config
from asyncrl.core.paths import COMPLETE, checkpoint_dir, latest_checkpoint
from asyncrl.learner import checkpoint
from asyncrl.learner.checkpointer import Checkpointer, Completer
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.policy import Learner


def fake_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    (path / "trainer.json").write_text("{}")
    if complete:
        (path / COMPLETE).touch()
    return path


def steps_left(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in (run_dir / "checkpoints").iterdir())


def test_only_the_newest_complete_checkpoints_are_kept_and_deletions_are_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="asyncrl.learner")
    for step in (10, 20, 30, 40):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 5, complete=False)  # a crash's leftover: not ours to judge
    written = fake_checkpoint(tmp_path, 50)

    deleted = checkpoint.prune(tmp_path, 2, written)

    assert [path.name for path in deleted] == ["step-000010", "step-000020", "step-000030"]
    assert steps_left(tmp_path) == [5, 40, 50]
    assert "deleted 3 older checkpoint(s) (learner.keep_checkpoints=2): step-000010, " in (
        caplog.text
    )


def test_keep_one_keeps_the_one_just_written_and_an_incomplete_one_being_written(tmp_path):
    fake_checkpoint(tmp_path, 10)
    written = fake_checkpoint(tmp_path, 20)
    fake_checkpoint(tmp_path, 30, complete=False)  # being written (or a leftover)
    checkpoint.prune(tmp_path, 1, written)
    assert steps_left(tmp_path) == [20, 30]
    assert latest_checkpoint(tmp_path) == written


def test_the_one_just_written_is_kept_even_when_newer_complete_ones_exist(tmp_path):
    # resumed by hand from an older checkpoint: a newer complete one from before stays
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 40)
    written = fake_checkpoint(tmp_path, 20)
    checkpoint.prune(tmp_path, 1, written)
    assert steps_left(tmp_path) == [20, 40]


def test_none_keeps_every_checkpoint(tmp_path):
    for step in (10, 20, 30):
        fake_checkpoint(tmp_path, step)
    assert checkpoint.prune(tmp_path, None, checkpoint_dir(tmp_path, 30)) == []
    assert steps_left(tmp_path) == [10, 20, 30]


def test_the_learner_keeps_the_newest_n_as_it_checkpoints(tmp_path, ranks: Ranks):
    overrides = ["model.tiny.num_layers=1", "model.tiny.hidden_size=16",
                 "model.tiny.intermediate_size=32", "model.tiny.num_heads=2",
                 "learner.keep_checkpoints=2"]  # fmt: skip
    config = load_config(None, overrides)
    torch.manual_seed(config.run.seed)
    learner = Learner(config, ranks)
    saved: list[int] = []
    buffer = SimpleNamespace(save_state=lambda step, _=None: saved.append(step))
    checkpointer = Checkpointer(
        learner, tmp_path, Completer(buffer, tmp_path, config.learner.keep_checkpoints)
    )

    for step in (1, 2, 3):
        learner.version = step
        checkpointer.save()
        assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, step)

    assert saved == [1, 2, 3]
    assert steps_left(tmp_path) == [2, 3]
