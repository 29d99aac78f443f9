"""`weights.transport=shm` and `collective` end to end: the quickstart's replicas load over
shared memory, or by the broadcast into their engines."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.run.status import read_metrics
from asyncrl.weights.shm.segment import NAME, POINTER_FILE, SHM_DIR
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SHARED_SEGMENT = re.compile(
    rf"weights shared in memory: {re.escape(str(SHM_DIR))}/({NAME.pattern})"
)


def launch_quickstart(run_dir: Path, transport: str) -> list[dict]:
    """12 steps of the quickstart with ``weights.transport``; its metrics records."""
    command = [
        sys.executable, "-m", "asyncrl", "launch", str(REPO / "configs/quickstart.yaml"),
        "run.total_steps=12", f"weights.transport={transport}", "tracking.aim=false",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    return read_metrics(run_dir)


def test_the_quickstart_over_shared_memory_loads_its_weights_there(tmp_path):
    run_dir = tmp_path / "run"
    records = launch_quickstart(run_dir, "shm")
    assert [r["version"] for r in records] == list(range(1, 13))
    last = records[-1]
    assert last["generators_weights_loads_shm_total"] >= 1  # the replicas read shared memory
    assert last.get("generators_weights_transfer_failures_total", 0.0) == 0.0
    assert last["weights_shm_published_total"] >= 1
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("generator*"))
    assert " over shm " in logs
    # the learner removed its segment and the record of it when it exited
    assert not (run_dir / POINTER_FILE).exists()
    # (its own segments, by the learner's log: tests running beside it may hold others)
    learner_logs = "".join(p.read_text() for p in (run_dir / "logs").glob("learner*"))
    ours = SHARED_SEGMENT.findall(learner_logs)
    assert ours, learner_logs[-2000:]
    assert not [name for name in ours if (SHM_DIR / name).exists()]
    assert processes_of(run_dir) == [], "the launcher left processes behind"


def test_the_quickstart_over_the_collective_path_loads_its_weights_there(tmp_path):
    run_dir = tmp_path / "run"
    records = launch_quickstart(run_dir, "collective")
    assert [r["version"] for r in records] == list(range(1, 13))
    last = records[-1]
    assert last["generators_weights_loads_collective_total"] >= 1  # broadcast into the engine
    assert last.get("generators_weights_transfer_failures_total", 0.0) == 0.0
    assert last["weights_collective_transfers_finished_total"] >= 1
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("generator*"))
    assert " over collective " in logs
    assert processes_of(run_dir) == [], "the launcher left processes behind"
