"""The local supervisor behind ``asyncrl launch``: one machine, one process per role.

It validates the config (before anything starts), creates the run directory,
writes the resolved config with the ports it picked, starts the buffer, the
learner and every generator replica with their output in ``RUN_DIR/logs/``,
prints one progress line per learner step from ``metrics.jsonl``, and stops
every process when the learner finishes, a process fails, or on Ctrl-C.
Children get SIGTERM if the supervisor itself dies, so none is orphaned.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TextIO

from asyncrl.config import Config, save_config
from asyncrl.paths import latest_checkpoint
from asyncrl.security import resolve_keys
from asyncrl.transport import free_port

STOP_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def make_run_dir(config: Config, run_dir: Path | None) -> Path:
    if run_dir is None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = Path(config.run.output_dir) / f"{config.run.name}-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    return run_dir


def resolve_ports(config: Config) -> Config:
    cluster = config.cluster
    updates = {
        "buffer_port": cluster.buffer_port or free_port(cluster.bind_address),
        "weights_port": cluster.weights_port or free_port(cluster.bind_address),
    }
    return config.model_copy(update={"cluster": cluster.model_copy(update=updates)})


class Progress:
    """Prints one line per new record of ``metrics.jsonl``."""

    def __init__(self, path: Path, total_steps: int, out: TextIO = sys.stdout):
        self.path = path
        self.total_steps = total_steps
        self.out = out
        self.offset = 0
        self.last: dict | None = None

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as file:
            file.seek(self.offset)
            while (line := file.readline()).endswith("\n"):
                self.offset = file.tell()
                self.last = json.loads(line)
                self.out.write(self.format(self.last) + "\n")
        self.out.flush()

    def format(self, m: dict) -> str:
        return (
            f"step {m['step'] + 1:>4}/{self.total_steps}  v{m['version']:<4}  "
            f"reward {m['reward_mean']:.3f}  "
            f"staleness {m['staleness_mean']:.2f}/{m['staleness_max']:.0f}  "
            f"samples/s {m['samples_per_s']:.1f}  wait {m['learner_wait_frac']:.0%}"
        )


class Supervisor:
    def __init__(self, config: Config, run_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, role: str, *extra: str, ranks: int = 1) -> None:
        """Start ``python -m asyncrl.roles ROLE RUN_DIR``; with ``ranks`` > 1 under torchrun."""
        log_file = (self.run_dir / "logs" / f"{name}.log").open("a")
        command = [sys.executable, "-m", "asyncrl.roles", role, str(self.run_dir), *extra]
        if ranks > 1:
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            command = [*torchrun, f"--nproc-per-node={ranks}", *command[1:]]
        self.processes[name] = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )

    def start_all(self, resume_from: Path | None = None) -> None:
        resume = ("--resume-from", str(resume_from)) if resume_from else ()
        self.start("buffer", "buffer", *resume)
        self.start("learner", "learner", *resume, ranks=self.config.learner.world_size)
        for pool in self.config.generators.resolved_pools():
            for index in range(pool.replicas):
                name = (
                    f"generator-{index}"
                    if pool.name == "default"
                    else f"generator-{pool.name}-{index}"
                )
                self.start(name, "generator", "--index", str(index), "--pool", pool.name)

    def failure(self) -> str | None:
        """A message naming the first process that exited when it should not have."""
        for name, process in self.processes.items():
            code = process.poll()
            if code is None or (name == "learner" and code == 0):
                continue
            tail = self.log_tail(name)
            log_path = self.run_dir / "logs" / f"{name}.log"
            return f"{name} exited with status {code}; last lines of {log_path}:\n{tail}"
        return None

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def launch(config: Config, run_dir: Path | None = None, resume: bool = False) -> int:
    """Run to completion; returns the exit status for the command line.

    With ``resume``, ``run_dir`` is an earlier run: it continues from its newest
    complete checkpoint, with fresh ports.
    """
    resume_from = None
    if resume:
        resume_from = latest_checkpoint(run_dir)
        if resume_from is None:
            print(f"asyncrl: {run_dir} has no complete checkpoint to resume from", file=sys.stderr)
            return 2
    config = resolve_keys(config, run_dir)  # CURVE keys missing: refused before anything starts
    run_dir = make_run_dir(config, run_dir)
    config = resolve_ports(config)
    save_config(config, run_dir / "config.yaml")
    print(f"run dir: {run_dir}", flush=True)
    if resume_from is not None:
        print(f"resuming from {resume_from}", flush=True)
    supervisor = Supervisor(config, run_dir)
    progress = Progress(run_dir / "metrics.jsonl", config.run.total_steps)
    started = time.perf_counter()
    try:
        supervisor.start_all(resume_from)
        while supervisor.processes["learner"].poll() is None:
            progress.poll()
            if (message := supervisor.failure()) is not None:
                print(f"asyncrl: run failed: {message}", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.2)
        progress.poll()
        if (message := supervisor.failure()) is not None:
            print(f"asyncrl: run failed: {message}", file=sys.stderr, flush=True)
            return 1
    except KeyboardInterrupt:
        print("asyncrl: interrupted, stopping every process", file=sys.stderr, flush=True)
        return 130
    finally:
        supervisor.stop_all()
    print(
        f"done in {time.perf_counter() - started:.1f}s; final policy in {run_dir / 'final'}",
        flush=True,
    )
    return 0
