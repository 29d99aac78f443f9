"""A launch in the background whose process tree the hardening tests watch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from asyncrl.run.status import read_metrics
from tests.helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


COMMON = ("tracking.aim=false", "buffer.heartbeat_timeout_s=3")


class Launch:
    """`asyncrl launch --quiet` on the quickstart in the background, its output in files."""

    def __init__(self, tmp_path: Path, *overrides: str, env: dict[str, str] | None = None):
        self.run_dir = tmp_path / "run"
        self.out, self.err = tmp_path / "launch.out", tmp_path / "launch.err"
        command = [
            sys.executable, "-m", "asyncrl", "launch", "--quiet",
            str(REPO / "configs/quickstart.yaml"), *COMMON, *overrides,
            "--run-dir", str(self.run_dir),
        ]  # fmt: skip
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=err,
                cwd=REPO,
                start_new_session=True,
                env={**os.environ, **(env or {})},
            )

    def steps(self) -> int:
        return len(read_metrics(self.run_dir))

    def wait_until(self, done, what: str, timeout_s: float = 180) -> None:
        """Until ``done()``, as long as the launcher runs (else its stderr is the failure)."""

        def still_running() -> None:
            assert self.process.poll() is None, self.stderr()

        wait_until(done, timeout_s, what=what, every_s=0.1, while_waiting=still_running)

    def stderr(self) -> str:
        return self.err.read_text()

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process under it."""
        launcher = psutil.Process(self.process.pid)
        return [launcher, *launcher.children(recursive=True)]

    def stop(self) -> None:
        """Whatever is left, after a failed assertion: SIGTERM to the launcher, then kill."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                for process in self.tree():
                    process.kill()
                self.process.wait()
