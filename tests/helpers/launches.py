"""Real `asyncrl launch` runs of the quickstart for the end-to-end tests: one run to its
end, and one started in the background and watched, with the ledger of what it trained.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from asyncrl.run.status import read_metrics

REPO = Path(__file__).resolve().parents[2]


def launch(run_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "asyncrl", "launch", str(REPO / "configs/quickstart.yaml"),
        *overrides, "--run-dir", str(run_dir),
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO)


PROMPTS_PER_STEP = 32  # configs/quickstart.yaml


COMMON = ("tracking.aim=false", "buffer.heartbeat_timeout_s=3")


class Launch:
    """`asyncrl launch --quiet ...` in the background, its output in files."""

    def __init__(self, run_dir: Path, *args: str):
        self.run_dir = run_dir
        self.out = run_dir.parent / f"{run_dir.name}.out"
        self.err = run_dir.parent / f"{run_dir.name}.err"
        command = [sys.executable, "-m", "asyncrl", "launch", "--quiet", *args]
        with self.out.open("a") as out, self.err.open("a") as err:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=err, cwd=REPO, start_new_session=True
            )

    def wait_for_step(self, steps: int, timeout_s: float = 120) -> None:
        """Until ``steps`` learner steps are in metrics.jsonl (counting every attempt)."""
        deadline = time.monotonic() + timeout_s
        while len(read_metrics(self.run_dir)) < steps:
            assert self.process.poll() is None, self.stderr()
            assert time.monotonic() < deadline, f"no step {steps} within {timeout_s}s"
            time.sleep(0.1)

    def wait(self, timeout_s: float = 180) -> int:
        return self.process.wait(timeout=timeout_s)

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process under it."""
        launcher = psutil.Process(self.process.pid)
        return [launcher, *launcher.children(recursive=True)]

    def stderr(self) -> str:
        return self.err.read_text()

    def stdout(self) -> str:
        return self.out.read_text()

    def kill(self) -> None:
        """Whatever is left, after a failed assertion."""
        if self.process.poll() is None:
            for process in self.tree():
                process.kill()
            self.process.wait()


def start(tmp_path: Path, *overrides: str) -> Launch:
    run_dir = tmp_path / "run"
    return Launch(run_dir, str(REPO / "configs/quickstart.yaml"), *COMMON, *overrides,
                  "--run-dir", str(run_dir))  # fmt: skip


def trained_groups(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the group ids trained in it; after a resume the last record of a step counts."""
    steps = {}
    for line in (run_dir / "trained_groups.jsonl").read_text().splitlines():
        record = json.loads(line)
        steps[record["step"]] = record["group_ids"]
    return steps


def assert_each_group_trained_once(steps: dict[int, list[int]], total_steps: int) -> list[int]:
    assert sorted(steps) == list(range(total_steps))
    assert all(len(groups) == PROMPTS_PER_STEP for groups in steps.values())
    trained = [group for groups in steps.values() for group in groups]
    assert len(set(trained)) == len(trained) == total_steps * PROMPTS_PER_STEP, "a repeat"
    return trained
