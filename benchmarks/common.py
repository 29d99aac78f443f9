"""Shared pieces of the run-level benchmarks: launch a run, watch its processes, read it.

A benchmark here drives ``asyncrl launch`` as a subprocess (the same command a
user types), so what it measures is the shipped system, start-up and all. While
the run goes, :class:`BusySampler` reads each role process's scheduler
counters, so the busy fraction of the learner and of each generator comes from
the kernel rather than from the code under test. Pure helpers (steady-state
throughput, the ideal async/sync ratio, samples to reach a target reward) sit
at the bottom and are unit-tested.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from asyncrl.run import status

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ machine


def machine_info() -> dict[str, object]:
    """What a reader needs to judge the figures: cores, memory, GPU, versions, load."""
    import torch

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpu = "none"
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            gpu = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.strip()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": gpu or "none",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": platform.platform(),
    }


def git_commit() -> str:
    """The checkout's commit (with ``+dirty`` when it has uncommitted changes): which code
    a result was measured on."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ------------------------------------------------------------- busy sampler


def _schedstat(pid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting for one) of a process's main thread."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    except OSError:
        return None
    return int(fields[0]), int(fields[1])


def role_name(cmdline: list[str]) -> str | None:
    """``learner``, ``buffer`` or ``generator-<pool->N`` from a role process's command line."""
    if "asyncrl.run.roles" not in cmdline:
        return None
    args = cmdline[cmdline.index("asyncrl.run.roles") + 1 :]
    if not args:
        return None
    role = args[0]
    if role != "generator":
        return role
    index = args[args.index("--index") + 1] if "--index" in args else "0"
    pool = args[args.index("--pool") + 1] if "--pool" in args else "default"
    return f"generator-{index}" if pool == "default" else f"generator-{pool}-{index}"


@dataclass
class Sample:
    """One reading: wall time, learner steps logged so far, per role (on-CPU, runnable) ns."""

    t: float
    steps: int
    roles: dict[str, tuple[int, int]]


@dataclass
class BusySampler:
    """Reads the main-thread scheduler counters of every role process of a launch.

    A role's *busy* fraction over a window is (time on a CPU + time runnable
    but waiting for one) / wall time: the share of the window in which its main
    thread had work, whether or not the shared cores let it run. Sleeping on a
    socket (the learner waiting for a batch, a replica waiting for prompts or
    the buffer's reply) is idle. Torch computes on the main thread with
    ``num_threads=1``; ZeroMQ's I/O threads are left out.
    """

    launcher_pid: int
    metrics_path: Path
    interval_s: float = 0.25
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _names: dict[int, str] = field(default_factory=dict)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._read())
            self._stop.wait(self.interval_s)

    def _read(self) -> Sample:
        roles: dict[str, tuple[int, int]] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.launcher_pid).children(recursive=True):
                name = self._names.get(child.pid)
                if name is None:
                    with contextlib.suppress(psutil.Error):
                        name = role_name(child.cmdline())
                    if name is None:
                        continue
                    self._names[child.pid] = name
                stat = _schedstat(child.pid)
                if stat is not None:
                    roles[name] = stat
        return Sample(time.monotonic(), count_lines(self.metrics_path), roles)

    def busy(self, first_step: int, last_step: int) -> dict[str, dict[str, float]]:
        """Per role: busy and on-CPU fractions between the readings that bracket the steps.

        The window opens at the first reading with more than ``first_step``
        metrics lines and closes at the last with at most ``last_step``, so
        start-up (imports, model build) and shutdown are left out.
        """
        inside = [s for s in self.samples if first_step < s.steps <= last_step]
        if len(inside) < 2:
            return {}
        start, end = inside[0], inside[-1]
        wall_ns = (end.t - start.t) * 1e9
        out = {}
        for name in sorted(set(start.roles) & set(end.roles)):
            run0, wait0 = start.roles[name]
            run1, wait1 = end.roles[name]
            out[name] = {
                "busy_frac": (run1 - run0 + wait1 - wait0) / wall_ns,
                "on_cpu_frac": (run1 - run0) / wall_ns,
            }
        out["_window"] = {
            "seconds": end.t - start.t,
            "from_steps": start.steps,
            "to_steps": end.steps,
        }
        return out


def count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


# ------------------------------------------------------------------ launch


@dataclass
class RunResult:
    run_dir: Path
    overrides: list[str]
    seconds: float
    """Wall time of the whole launch, start-up and shutdown included."""
    metrics: list[dict]
    sampler: BusySampler
    loadavg: tuple[float, float]
    """The machine's 1-minute load average when the launch started and when it ended."""


def launch(
    config: Path,
    overrides: list[str],
    run_dir: Path,
    nice: int = 0,
    timeout_s: float = 1800.0,
) -> RunResult:
    """Run ``asyncrl launch CONFIG OVERRIDES --run-dir RUN_DIR --quiet`` to completion."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    command = [sys.executable, "-m", "asyncrl", "launch", str(config), *overrides]
    command += ["--run-dir", str(run_dir), "--quiet"]
    if nice:
        command = ["nice", "-n", str(nice), *command]
    log_path = run_dir.parent / f"{run_dir.name}.launch.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    load_before = loadavg()[0]
    started = time.monotonic()
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        sampler = BusySampler(process.pid, run_dir / "metrics.jsonl")
        sampler.start()
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()  # the launcher stops its own processes on SIGTERM
            process.wait(timeout=30)
            raise
        finally:
            sampler.stop()
    seconds = time.monotonic() - started
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"`{' '.join(command)}` exited with {code}; {log_path}:\n{tail}")
    load = (load_before, loadavg()[0])
    return RunResult(run_dir, overrides, seconds, read_metrics(run_dir), sampler, load)


def read_metrics(run_dir: Path) -> list[dict]:
    """RUN_DIR/metrics.jsonl as one record per training step (the last line of a step
    counts after a resume; eval-only lines, such as the final policy's, are left out)."""
    by_step = {int(record["step"]): record for record in status.read_metrics(run_dir)}
    return [by_step[step] for step in sorted(by_step)]


# ------------------------------------------------------------ pure helpers


def steady_throughput(metrics: list[dict], skip: int) -> dict[str, float]:
    """Samples/s and tokens/s between the end of step ``skip - 1`` and the last step.

    The first steps carry start-up (replicas still loading, first-step kernels), so
    rates are taken from the difference of two points of the run, not from the
    run's cumulative ``samples_per_s``. Tokens: every token the learner trained on
    (prompt and response) and the response tokens alone.
    """
    if not 0 < skip < len(metrics):
        raise ValueError(f"skip={skip} must leave at least one step of {len(metrics)}")
    first, last = metrics[skip - 1], metrics[-1]
    steps = metrics[skip:]
    seconds = last["time_s"] - first["time_s"]
    samples = last["samples_total"] - first["samples_total"]
    trained_tokens = sum(m["learner_tokens_per_s"] * m["time_update_s"] for m in steps)
    per_step = samples / len(steps)
    response_tokens = sum(m["response_len_mean"] * per_step for m in steps)
    return {
        "seconds": seconds,
        "steps": len(steps),
        "samples_per_s": samples / seconds,
        "tokens_per_s": trained_tokens / seconds,
        "response_tokens_per_s": response_tokens / seconds,
        "step_s": seconds / len(steps),
    }


def ideal_ratio(tg: float, tt: float) -> float:
    """Best async/sync throughput ratio with generation time ``tg`` and training time ``tt``.

    Synchronous steps take ``tg + tt``; perfectly overlapped ones take the longer
    of the two, so the ratio is at most 2, reached when they are equal.
    """
    if tg <= 0 or tt <= 0:
        raise ValueError(f"times must be positive, got tg={tg}, tt={tt}")
    return (tg + tt) / max(tg, tt)


def speedup_captured(measured: float, ideal: float) -> float:
    """Share of the possible gain the async run got: 0 = no faster than sync, 1 = ideal."""
    if ideal <= 1:
        raise ValueError(f"an ideal ratio of {ideal} leaves no gain to capture")
    return (measured - 1) / (ideal - 1)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values (the first ones average what exists)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def first_reaching(
    xs: list[float], rewards: list[float], target: float, window: int
) -> float | None:
    """The first ``x`` at which the trailing mean of ``window`` rewards reaches ``target``."""
    if len(xs) != len(rewards):
        raise ValueError(f"{len(xs)} x values for {len(rewards)} rewards")
    for x, smoothed in zip(xs, moving_average(rewards, window), strict=True):
        if smoothed >= target:
            return x
    return None


def median(values: list[float]) -> float:
    return statistics.median(values)
