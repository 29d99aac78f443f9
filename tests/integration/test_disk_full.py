"""A full disk under the learner: it stops at once with one line naming the file, never hangs.

The disk is real: a small tmpfs, filled by a writer of the test's own that keeps taking
every byte freed (as another process filling the disk would). Mounting needs root (CI
and the dev machine run as root); without it these tests skip and say so.

Before the fix the learner, with aim on (the quickstart's default), hung for ever in
aim's exit handler after the first failed write, and the launcher printed nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.learner import checkpoint, distributed
from asyncrl.learner.policy import Learner
from asyncrl.run.status import read_metrics
from tests.helpers.launches import Launch
from tests.helpers.run_processes import processes_of

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.tiny.num_layers=1", "model.tiny.hidden_size=16", "model.tiny.intermediate_size=32",
        "model.tiny.num_heads=2"]  # fmt: skip
STOPPED = re.compile(
    r"cannot write \S+/(metrics|trained_groups)\.jsonl: No space left on device \(errno 28\); "
    r"the learner stops"
)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs (aim alone takes megabytes), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI and the dev machine run as root)")
    path = tmp_path / "disk"
    path.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)]
    result = subprocess.run(mount, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Filler:
    """Takes every byte of ``disk`` and, until stopped, every byte freed later."""

    def __init__(self, disk: Path):
        self.path = disk / "filler"
        self.full = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._fill, daemon=True)

    def __enter__(self) -> Filler:
        self.thread.start()
        self.full.wait(timeout=60)
        assert self.full.is_set(), "the disk never filled"
        return self

    def __exit__(self, *_) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

    def _fill(self) -> None:
        block = b"\0" * 4096  # a tmpfs page: the last one free is taken too
        with self.path.open("ab", buffering=0) as file:
            while not self.stopped.is_set():
                try:
                    file.write(block)
                except OSError:
                    self.full.set()
                    self.stopped.wait(0.02)


TRACKER_PROGRAM = """
import sys
from pathlib import Path
from asyncrl.core.tracking import Tracker

tracker = Tracker(Path(sys.argv[1]), "full", {"a": 1}, use_aim=True)
try:
    for step in range(10**9):  # as the learner does each step, until a write fails
        tracker.log(step, {"reward_mean": 0.5, "version": step + 1})
        tracker.log_generations(step, [{"prompt": "123=", "response": "234"}])
finally:
    tracker.close()
"""


def test_aim_and_the_metrics_on_a_full_disk_end_the_process_with_the_error(disk):
    # before the fix: aim's write failed, the exception ended the loop, and the process
    # then hung for ever in aim's exit handler
    run_dir = disk / "run"
    run_dir.mkdir()
    with Filler(disk):
        result = subprocess.run(
            [sys.executable, "-c", TRACKER_PROGRAM, str(run_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"asyncrl.core.tracking.RecordWriteError: cannot write {run_dir / 'metrics.jsonl'}: "
        "No space left on device (errno 28); the learner stops"
    )


@pytest.fixture
def learner(disk: Path) -> Iterator[Learner]:
    """A single-rank learner in this process (a process group of one)."""
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    try:
        ranks = distributed.init("cpu")
        config = load_config(None, TINY)
        torch.manual_seed(config.run.seed)
        yield Learner(config, ranks)
    finally:
        distributed.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def test_a_checkpoint_on_a_full_disk_is_one_line_and_gives_its_space_back(disk, learner):
    path = disk / "checkpoints" / "step-000001"
    path.parent.mkdir()
    with Filler(disk), pytest.raises(checkpoint.CheckpointWriteError) as raised:
        learner.save_checkpoint(path)
    assert str(raised.value) == (
        f"cannot write checkpoint {path}: rank 0: No space left on device (errno 28); "
        "the learner stops"
    )
    assert not path.exists()


@pytest.mark.slow
def test_a_run_whose_disk_fills_stops_at_once_naming_the_file(tmp_path, disk):
    # aim on, as in the quickstart; the logs (and the launcher's output) on another
    # disk, so the learner's last words can be read: on the full disk they may not fit
    (disk / "run").mkdir()
    run_dir = tmp_path / "run"
    run_dir.symlink_to(disk / "run")
    logs = tmp_path / "logs"
    logs.mkdir()
    (run_dir / "logs").symlink_to(logs)
    run = Launch(run_dir, str(REPO / "configs/quickstart.yaml"), "tracking.aim=true",
                 "run.total_steps=100000", "--run-dir", str(run_dir))  # fmt: skip
    try:
        run.wait_for_step(3)
        with Filler(disk):
            full_at = time.monotonic()
            status = run.wait(timeout_s=120)  # before the fix: never (aim's exit hung)
            exited_s = time.monotonic() - full_at
    finally:
        run.kill()

    print(f"disk full -> launcher exit: {exited_s:.1f}s after {len(read_metrics(run_dir))} steps")
    assert status == 1, run.stderr()
    assert "learner exited with status 1" in run.stderr()
    learner_log = (logs / "learner.log").read_text()
    [stopped] = [line for line in learner_log.splitlines() if "ERROR" in line]
    assert STOPPED.search(stopped), learner_log[-2000:]
    assert STOPPED.search(run.stderr())  # the launcher shows it
    assert processes_of(run_dir) == []
