"""The buffer killed mid-run: the learner's final checkpoint is still complete, and a run
resumed from it trains no group twice.

The learner writes the buffer's part itself (``buffer.json`` with ``trained_since``,
``written_by: learner``) when the buffer does not answer; before, the checkpoint on the
stop was never marked complete and up to ``checkpoint_every`` steps were lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.core.paths import checkpoint_dir, latest_checkpoint
from asyncrl.run.status import read_metrics
from tests.helpers.launches import (
    COMMON,
    Launch,
    assert_each_group_trained_once,
    start,
    trained_groups,
)
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow

EVERY = 5


def test_a_killed_buffer_leaves_a_complete_checkpoint_of_the_last_step_and_resume_repeats_none(
    tmp_path,
):
    run = start(tmp_path, "run.total_steps=1000", f"learner.checkpoint_every={EVERY}")
    try:
        run.wait_for_step(EVERY + 3)  # past a checkpoint the buffer wrote itself
        [buffer] = [p for p in processes_of(run.run_dir) if p.cmdline()[3:4] == ["buffer"]]
        buffer.kill()
        assert run.wait() == 1, run.stderr()
    finally:
        run.kill()

    assert "buffer exited with status -9" in run.stderr()
    steps_done = len(read_metrics(run.run_dir))
    final = latest_checkpoint(run.run_dir)
    assert final == checkpoint_dir(run.run_dir, steps_done), run.stderr()
    assert f"asyncrl launch --resume {run.run_dir}" in run.stderr()
    if steps_done % EVERY:  # the stop's own checkpoint (else the buffer may have written it)
        assert_written_by_the_learner(run.run_dir, final, steps_done)

    total = steps_done + 6
    resumed = Launch(run.run_dir, "--resume", str(run.run_dir), *COMMON, f"run.total_steps={total}")
    try:
        assert resumed.wait() == 0, resumed.stderr()
    finally:
        resumed.kill()

    assert f"resuming from {final}" in resumed.stdout()
    assert_each_group_trained_once(trained_groups(run.run_dir), total)
    assert processes_of(run.run_dir) == []


def assert_written_by_the_learner(run_dir: Path, final: Path, steps_done: int) -> None:
    """The buffer's part: the last periodic checkpoint's plus every group trained since."""
    state = json.loads((final / "buffer.json").read_text())
    assert state["written_by"] == "learner"
    base = checkpoint_dir(run_dir, steps_done - steps_done % EVERY)
    trained = trained_groups(run_dir)
    since = sorted(g for step in range(steps_done - steps_done % EVERY, steps_done)
                   for g in trained[step])  # fmt: skip
    assert state["trained_since"] == since
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert f"the buffer's part was reconstructed by the learner from {base.name}" in learner_log
