"""Faults under `asyncrl launch`: a generator killed, the launcher signalled, the whole run killed.

Each test starts the real command on the quickstart config (shortened), injects
the fault from outside as an operator or the OS would, and checks what
survives: the groups the learner trained (``trained_groups.jsonl``), the
checkpoints, the metrics, and that no process of the run is left.
"""

from __future__ import annotations

import json
import signal

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.core.paths import latest_checkpoint
from asyncrl.run.status import read_metrics
from asyncrl.run.supervision import stop_timeout_s
from tests.helpers.launches import (
    COMMON,
    Launch,
    assert_each_group_trained_once,
    start,
    trained_groups,
)
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow

GROUP_SIZE = 8
"""algorithm.group_size in configs/quickstart.yaml (an evicted group drops all its samples)."""


def test_a_killed_generator_is_restarted_and_the_run_trains_every_group(tmp_path):
    # One replica: the steps after the kill can only come from its restarted process,
    # so the restart must show in the metrics however slowly that process starts.
    run = start(tmp_path, "run.total_steps=30", "generators.replicas=1")
    try:
        run.wait_for_step(3)
        [victim] = [p for p in processes_of(run.run_dir) if p.cmdline()[3:4] == ["generator"]]
        victim.kill()
        assert run.wait() == 0, run.stderr()
    finally:
        run.kill()

    assert "generator-0 exited with status -9" in run.stderr()
    assert "generator-0 started again (restart 1)" in run.stderr()
    assert "step   30/30" in run.stdout()
    records = read_metrics(run.run_dir)
    assert [r["version"] for r in records] == list(range(1, 31))
    # the restarted replica (gen-0-r1) reported its restart count through the buffer
    assert records[-1]["generators_restarts_total"] == 1
    assert records[-1]["pool_default_restarts_total"] == 1
    assert_each_group_trained_once(trained_groups(run.run_dir), 30)
    assert processes_of(run.run_dir) == []


@pytest.mark.parametrize(
    ("stop_signal", "status", "ranks"),
    [(signal.SIGINT, 130, 1), (signal.SIGTERM, 143, 2)],
    ids=["sigint", "sigterm-two-ranks"],
)
def test_a_signal_stops_every_process_after_a_final_checkpoint(
    tmp_path, stop_signal, status, ranks
):
    # checkpoint_every=1000: any checkpoint is the one written on the signal
    run = start(tmp_path, "run.total_steps=1000", "learner.checkpoint_every=1000",
                f"learner.world_size={ranks}")  # fmt: skip
    try:
        run.wait_for_step(4)
        processes = run.tree()
        assert len(processes) >= 4 + ranks  # launcher, buffer, learner ranks, generators
        run.process.send_signal(stop_signal)
        # the launcher kills what is left by stop_timeout_s; a little slack for the kill itself
        limit_s = stop_timeout_s(load_config(run.run_dir / "config.yaml")) + 5
        assert run.wait(timeout_s=limit_s) == status, run.stderr()
    finally:
        run.kill()

    assert psutil.wait_procs(processes, timeout=1)[1] == []
    assert processes_of(run.run_dir) == []
    steps_done = len(read_metrics(run.run_dir))
    checkpoint = latest_checkpoint(run.run_dir)
    assert checkpoint is not None and checkpoint.name == f"step-{steps_done:06d}", run.stderr()
    assert json.loads((checkpoint / "trainer.json").read_text())["step"] == steps_done
    assert (checkpoint / "buffer.json").exists()
    assert "stopped by a signal" in (run.run_dir / "logs" / "learner.log").read_text()
    assert f"asyncrl launch --resume {run.run_dir}" in run.stderr()


def test_a_run_killed_outright_resumes_without_repeating_or_skipping_a_prompt(tmp_path):
    run = start(tmp_path, "run.total_steps=30", "learner.checkpoint_every=5")
    try:
        run.wait_for_step(13)  # past the checkpoint at 10, so some trained steps are lost
        processes = run.tree()
        for process in processes:  # as a power cut would: nothing gets to clean up
            process.kill()
        psutil.wait_procs(processes, timeout=10)
    finally:
        run.kill()
    checkpoint = latest_checkpoint(run.run_dir)
    assert checkpoint is not None
    first_attempt = read_metrics(run.run_dir)

    resumed = Launch(run.run_dir, "--resume", str(run.run_dir), *COMMON)
    try:
        assert resumed.wait() == 0, resumed.stderr()
    finally:
        resumed.kill()

    assert f"resuming from {checkpoint}" in resumed.stdout()
    trained = assert_each_group_trained_once(trained_groups(run.run_dir), 30)
    # Nothing skipped without a name: every prompt handed out (0 .. cursor-1) is exactly
    # one of trained, still waiting in the buffer at the final checkpoint (dispatched, or
    # ready and not yet served), or recorded there as skipped, by id and reason. On a
    # loaded machine a descheduled generator's group can arrive too stale: its prompt is
    # handed out again (buffer.stale_retries), and only then skipped.
    final = json.loads((run.run_dir / "checkpoints/step-000030/buffer.json").read_text())
    waiting = final["unfinished_groups"]
    skipped = [entry["group_id"] for entry in final["skipped_groups"]]
    named = sorted([*trained, *waiting, *skipped])
    assert named == list(range(final["cursor"])), "a prompt lost, or named twice"
    assert {entry["reason"] for entry in final["skipped_groups"]} <= {"stale"}  # no filters
    record = run.run_dir / "skipped_prompts.jsonl"
    lines = record.read_text().splitlines() if record.exists() else []
    listed = [json.loads(line) for line in lines]
    assert listed == final["skipped_groups"]
    second_attempt = read_metrics(run.run_dir)[len(first_attempt) :]
    assert second_attempt[-1]["buffer_prompts_skipped_stale"] == len(skipped)
    attempts = (first_attempt, second_attempt)
    evictions = sum(records[-1]["buffer_dropped_stale"] for records in attempts)
    assert len(skipped) * GROUP_SIZE <= evictions
    assert processes_of(run.run_dir) == []
