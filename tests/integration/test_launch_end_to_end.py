"""`asyncrl launch` end to end: real processes, real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.run.status import read_metrics
from tests.helpers.launches import REPO, launch
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_synchronous_config_never_trains_on_stale_data(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(
        run_dir, "run.total_steps=20", "buffer.max_staleness=0", "learner.sync_interval=1",
        "tracking.aim=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(run_dir)
    assert [r["staleness_max"] for r in records] == [0.0] * 20
    assert records[-1]["buffer_dropped_stale"] == 0


def test_invalid_config_stops_before_any_process_starts(tmp_path):
    run_dir = tmp_path / "run"
    result = launch(run_dir, "buffer.max_stalenes=2", timeout=60)
    assert result.returncode == 2
    assert "did you mean 'buffer.max_staleness'" in result.stderr
    assert not run_dir.exists()


def test_a_crashing_learner_fails_the_run_with_its_log(tmp_path):
    run_dir = tmp_path / "run"
    # A model name that does not exist locally makes the learner fail at start-up.
    result = launch(
        run_dir, "model.tiny=null", "model.name_or_path=/nonexistent/model", "tracking.aim=false",
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "exited with status" in result.stderr and "/nonexistent/model" in result.stderr
    assert processes_of(run_dir) == []


def test_quickstart_meets_its_reward_target(tmp_path):
    """The README's promise: last-10-step reward >= 0.8 and >= 3x the first 3 steps; on the
    way, every version in order, staleness within ``buffer.max_staleness: 1``, new weights
    reaching both generators, and nothing left running."""
    run_dir = tmp_path / "run"
    result = launch(run_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(run_dir)
    rewards = [r["reward_mean"] for r in records]
    first, last = mean(rewards[:3]), mean(rewards[-10:])
    assert last >= 0.8 and last >= 3 * first, (first, last)
    assert (run_dir / ".aim").is_dir()

    assert [r["version"] for r in records] == list(range(1, 601))
    assert max(r["staleness_max"] for r in records) <= 1
    assert records[-1]["samples_total"] == 600 * 256
    # both generators produced versions past the first: weights really reached them ...
    assert max(r["staleness_mean"] for r in records) > 0
    # ... and their own counters reach the metrics through the buffer
    assert records[-1]["generators_weight_swaps_total"] >= 400
    assert 0 < records[-1]["generators_weight_swap_latency_s"] < 30
    assert records[-1]["generators_reward_errors_total"] == 0
    assert (run_dir / "config.yaml").exists() and (run_dir / "final" / "config.json").exists()
    assert f"run dir: {run_dir}" in result.stdout
    assert "step  600/600" in result.stdout
    assert processes_of(run_dir) == [], "the launcher left processes behind"


def test_two_learner_ranks_under_torchrun(tmp_path):
    """learner.world_size=2: torchrun starts two FSDP2 ranks; rank 0 alone talks and logs."""
    run_dir = tmp_path / "run"
    result = launch(
        run_dir, "run.total_steps=40", "learner.world_size=2", "learner.lr=1e-3",
        "tracking.aim=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, 41))
    assert all(r["staleness_max"] <= 1 for r in records)
    rewards = [r["reward_mean"] for r in records]
    assert mean(rewards[-5:]) > mean(rewards[:3]), rewards  # it learns from the first steps
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "learner-0 " in log and "learner-1 " in log  # both ranks ran, named in the log
    assert (run_dir / "final" / "model.safetensors").exists()
    assert processes_of(run_dir) == [], "the launcher left processes behind"


def test_resume_continues_from_the_last_checkpoint(tmp_path):
    """Checkpoints every 3 steps; `--resume` continues at the saved version, buffer included."""
    run_dir = tmp_path / "run"
    first = launch(run_dir, "run.total_steps=6", "learner.checkpoint_every=3", "tracking.aim=false")
    assert first.returncode == 0, first.stdout + first.stderr
    for step in (3, 6):
        checkpoint = run_dir / "checkpoints" / f"step-{step:06d}"
        assert (checkpoint / "COMPLETE").exists()
        state = json.loads((checkpoint / "buffer.json").read_text())
        assert state["cursor"] >= step * 32  # 32 prompts per step were handed out at least
        assert json.loads((checkpoint / "trainer.json").read_text())["step"] == step

    command = [
        sys.executable, "-m", "asyncrl", "launch", "--resume", str(run_dir),
        "run.total_steps=10", "tracking.aim=false",
    ]  # fmt: skip
    second = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"resuming from {run_dir / 'checkpoints' / 'step-000006'}" in second.stdout
    assert [r["version"] for r in read_metrics(run_dir)] == list(range(1, 11))
    assert "resumed from" in (run_dir / "logs" / "buffer.log").read_text()
    assert "at version 6" in (run_dir / "logs" / "learner.log").read_text()
    assert processes_of(run_dir) == []
