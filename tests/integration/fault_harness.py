"""Faults injected into real `asyncrl launch` runs, for the fault table of docs/running.md.

Each scenario starts the real command on the quickstart config (shortened),
injects its faults from outside as an operator, the OS or a user's code would,
and returns a :class:`Case` per fault: the exit status, the lines that name the
fault, what was lost, what resume did, which processes were left, and how long
it took. ``tests/integration/test_faults.py`` asserts on the cases;
``benchmarks/fault_table.py`` runs the same scenarios and writes the table.

The injections are real: ``kill -9`` and ``SIGSTOP``; a small tmpfs kept full to
the last page (disk full); a read-only mount (an unwritable run directory, an
aim repository that turns read-only mid-run); a reward function file that
hangs, exits or prints 64 MiB. Only the slow chunk is planted: a
``sitecustomize`` on ``PYTHONPATH`` makes one engine call of one generator
sleep. The mounts need root (CI and this machine run as root); without it
:class:`MountUnavailable` says why and the test skips.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from asyncrl.core.paths import latest_checkpoint
from asyncrl.run.status import read_metrics

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
HEARTBEAT_S = 3
STALL_S = 10
"""run.stall_timeout_s of these runs: the smallest the config allows (the default is 900 s;
a role still starting gets the watchdog's START_TIMEOUT_S)."""
FAST = (
    "tracking.aim=false",
    f"buffer.heartbeat_timeout_s={HEARTBEAT_S}",
    f"run.stall_timeout_s={STALL_S}",
)
LONG = "run.total_steps=100000"
"""Runs that go on after their faults end with SIGTERM once the effects are seen: their
length then depends on what was measured, not on how fast this machine trains."""
POLL_S = 0.1
WAIT_S = 240.0
"""The longest any one wait of a scenario lasts (generous: the machine may be loaded)."""


class MountUnavailable(Exception):
    """A tmpfs or bind mount could not be made (not root, or no mount namespace rights)."""


# --------------------------------------------------------------------------- a launch


class Launch:
    """`asyncrl launch --quiet ...` in the background, watched from outside.

    Its output goes to files beside the run directory (never inside it: the disk-full
    scenario fills the run directory's disk). Every wait records when each learner step
    first showed in ``metrics.jsonl`` and which processes the launcher had, so the time a
    fault held the learner up and the processes left after the launcher can be told.
    """

    def __init__(
        self, run_dir: Path, *args: str, env: dict[str, str] | None = None, logs: Path | None = None
    ):
        self.run_dir = run_dir
        logs = logs or run_dir.parent / "launches"
        logs.mkdir(parents=True, exist_ok=True)
        index = len(list(logs.glob(f"{run_dir.name}-*.out")))
        self.out = logs / f"{run_dir.name}-{index}.out"
        self.err = logs / f"{run_dir.name}-{index}.err"
        self.first_step = len(read_metrics(run_dir)) if run_dir.exists() else 0
        self.step_times: list[float] = []
        """``time.time()`` when each step of this launch was first seen."""
        self.seen: dict[int, psutil.Process] = {}
        self.roles: dict[int, str] = {}
        """The role (``learner``, ``generator``, ...) of each process seen, by pid."""
        self.exits: dict[int, float] = {}
        """``time.time()`` by which each process seen had exited, by pid."""
        self._looked_at = 0.0
        self._metrics: list[dict] = []
        self._metrics_size = -1
        command = [sys.executable, "-m", "asyncrl", "launch", "--quiet", *args]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=err, cwd=REPO, start_new_session=True,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.started = time.time()
        self.ended: float | None = None

    # -------------------------------------------------------------- watching

    def observe(self) -> None:
        """Note new steps (with the time they were seen) and the launcher's processes."""
        steps = self.steps() - self.first_step
        now = time.time()
        self.step_times += [now] * max(0, steps - len(self.step_times))
        if now - self._looked_at >= 1.0 and self.process.poll() is None:
            self._looked_at = now
            for process in self.tree():
                self.note(process)
        for pid, process in self.seen.items():
            if pid not in self.exits and not alive(process):
                self.exits[pid] = now
        if self.ended is None and self.process.poll() is not None:
            self.ended = now

    def note(self, process: psutil.Process) -> None:
        """Follow ``process`` (to tell when it exits, and whether it is left)."""
        if process.pid not in self.seen:
            self.seen[process.pid] = process
            self.roles[process.pid] = role_of(process)

    def until(self, what: str, done: Callable[[], bool], timeout_s: float = WAIT_S) -> float:
        """Wait until ``done()``; the ``time.time()`` it became true. Fails if the launcher
        exits first (use :meth:`wait` for that) or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.observe()
            if done():
                return time.time()
            assert self.process.poll() is None, f"the run ended before {what}:\n{self.stderr()}"
            late = f"no {what} within {timeout_s:.0f}s:\n{self.stderr()}"
            assert time.monotonic() < deadline, late
            time.sleep(POLL_S)

    def wait_for_step(self, steps: int) -> float:
        """Until this launch's learner logged ``steps`` steps in all (every attempt counted)."""
        return self.until(f"step {steps}", lambda: self.steps() >= steps)

    def wait(self, timeout_s: float = WAIT_S) -> int:
        """The launcher's exit status, once it exited."""
        deadline = time.monotonic() + timeout_s
        while self.process.poll() is None:
            self.observe()
            assert time.monotonic() < deadline, f"still running after {timeout_s:.0f}s"
            time.sleep(POLL_S)
        self.observe()
        return self.process.returncode

    def wait_for_new_steps(self, steps: int) -> float:
        """Until this launch's learner logged ``steps`` more steps than when it started."""
        return self.until(f"{steps} steps", lambda: self.new_steps() >= steps)

    def steps(self) -> int:
        """Steps in ``metrics.jsonl``, every attempt counted."""
        return len(self.metrics())

    def new_steps(self) -> int:
        """Steps this launch logged."""
        return self.steps() - self.first_step

    def trained_to(self) -> int:
        """The learner's step count after its last logged step (0 before any)."""
        records = self.metrics()
        return records[-1]["step"] + 1 if records else 0

    def metrics(self) -> list[dict]:
        """The records of ``metrics.jsonl`` (read again only when the file grew)."""
        size = file_size(self.run_dir / "metrics.jsonl")
        if size != self._metrics_size:
            self._metrics, self._metrics_size = read_metrics(self.run_dir), size
        return self._metrics

    def held_up_s(self, since: float, until: float | None = None) -> float:
        """The longest the learner went without a step between ``since`` and ``until``
        (its last step seen, by default)."""
        end = until or float("inf")
        times = [since, *(t for t in self.step_times if since < t <= end)]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    # ------------------------------------------------------------- processes

    def tree(self) -> list[psutil.Process]:
        """The launcher and every process under it."""
        with contextlib.suppress(psutil.NoSuchProcess):
            launcher = psutil.Process(self.process.pid)
            return [launcher, *launcher.children(recursive=True)]
        return []

    def leftovers(self) -> list[str]:
        """Processes of this launch (seen under the launcher, or naming the run directory)
        still alive: ``pid name`` each."""
        self.observe()
        found = {p.pid: p for p in self.seen.values() if alive(p)}
        found |= {p.pid: p for p in processes_of(self.run_dir) if alive(p)}
        return [f"{pid} {describe(process)}" for pid, process in sorted(found.items())]

    def role(self, role: str, index: int | None = None, rank: int | None = None) -> psutil.Process:
        """The live process of ``role`` (a generator by ``index``, a learner by ``rank``)."""
        for process in processes_of(self.run_dir):
            command = process.cmdline()
            if command[2:4] != ["asyncrl.run.roles", role]:
                continue
            if index is not None and command[command.index("--index") + 1] != str(index):
                continue
            if rank is not None and process.environ().get("RANK", "0") != str(rank):
                continue
            return process
        raise AssertionError(f"no live {role} process (index {index}, rank {rank})")

    def kill(self) -> None:
        """Whatever of this launch is left, after a failed assertion or a killed launcher."""
        for process in [*self.tree(), *self.seen.values(), *processes_of(self.run_dir)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.is_running():
                    process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Signal the launcher and wait for it: the run's clean stop."""
        self.process.send_signal(signum)
        return self.wait()

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names ``run_dir`` (as run_processes.py
    finds them, zombies left out: a killed child not yet reaped is gone)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(process.info["cmdline"] or []) and alive(process):
            found.append(process)
    return found


def alive(process: psutil.Process) -> bool:
    """Running and not a zombie (a killed child not reaped yet is gone for our purposes)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def role_of(process: psutil.Process) -> str:
    """``buffer``, ``learner``, ``generator`` (``python -m asyncrl.run.roles ROLE``),
    ``launcher``, ``reward worker``, else the process's name."""
    try:
        command = process.cmdline()
        if command[2:3] == ["asyncrl.run.roles"]:
            return command[3]
        if command[2:4] == ["asyncrl", "launch"]:
            return "launcher"
        return "reward worker" if "_worker_main" in " ".join(command) else process.name()
    except (psutil.Error, IndexError):
        return "?"


def describe(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline()[:5]) or process.name()
    except psutil.Error:
        return "?"


def start(
    run_dir: Path, *overrides: str, env: dict[str, str] | None = None, logs: Path | None = None
) -> Launch:
    """A new run of the quickstart config with the FAST settings and ``overrides``."""
    args = (str(QUICKSTART), *FAST, *overrides, "--run-dir", str(run_dir))
    return Launch(run_dir, *args, env=env, logs=logs)


def resume(run_dir: Path, *overrides: str, logs: Path | None = None) -> Launch:
    """``asyncrl launch --resume RUN_DIR`` with ``overrides``."""
    return Launch(run_dir, "--resume", str(run_dir), *overrides, logs=logs)


def resumed_from(launch: Launch) -> int | None:
    """The checkpoint step a ``--resume`` launch said it resumed from."""
    for line in launch.stdout().splitlines():
        if line.startswith("resuming from "):
            return int(line.rsplit("step-", 1)[1])
    return None


def gone(launch: Launch, timeout_s: float = WAIT_S) -> float:
    """Wait until no process of ``launch`` is alive; the ``time.time()`` it was so."""
    deadline = time.monotonic() + timeout_s
    while launch.leftovers():
        assert time.monotonic() < deadline, f"left after {timeout_s:.0f}s: {launch.leftovers()}"
        time.sleep(POLL_S)
    return time.time()


# --------------------------------------------------------------------- the run's ledger


def trained_groups(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the group ids trained in it; after a resume the last record of a step counts."""
    steps: dict[int, list[int]] = {}
    path = run_dir / "trained_groups.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            steps[record["step"]] = record["group_ids"]
    return steps


@dataclass
class Ledger:
    """Where each prompt handed out (``0 .. cursor-1``) ended, at a checkpoint."""

    trained: list[int] = field(repr=False)
    waiting: list[int] = field(repr=False)
    skipped: list[dict]
    cursor: int
    listed: list[dict]
    """``RUN_DIR/skipped_prompts.jsonl`` when the ledger was taken (it should be ``skipped``)."""

    def repeated(self) -> list[int]:
        """Prompts trained twice (in the steps up to the checkpoint)."""
        seen: set[int] = set()
        return sorted(g for g in self.trained if g in seen or seen.add(g))

    def unaccounted(self) -> list[int]:
        """Prompts handed out and neither trained, waiting nor recorded as skipped."""
        named = {*self.trained, *self.waiting, *(s["group_id"] for s in self.skipped)}
        return sorted(set(range(self.cursor)) - named)


def ledger(run_dir: Path, checkpoint: Path) -> Ledger:
    """The prompts' fate at ``checkpoint``: trained in its steps, waiting, skipped."""
    state = json.loads((checkpoint / "buffer.json").read_text())
    step = int(checkpoint.name.removeprefix("step-"))
    steps = trained_groups(run_dir)
    trained = [group for s in range(step) for group in steps.get(s, [])]
    return Ledger(trained, state["unfinished_groups"], state.get("skipped_groups", []),
                  state["cursor"], skipped_prompts(run_dir))  # fmt: skip


def skipped_prompts(run_dir: Path) -> list[dict]:
    """``RUN_DIR/skipped_prompts.jsonl``: the prompts given up on, by id."""
    path = run_dir / "skipped_prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint, None without one."""
    checkpoint = latest_checkpoint(run_dir)
    return None if checkpoint is None else int(checkpoint.name.removeprefix("step-"))


# ------------------------------------------------------------------------- a case


@dataclass
class Case:
    """What one fault did to a run: the test asserts on it, the table reports it."""

    fault: str
    status: int | None = None
    """The launcher's exit status (None when the launcher itself was killed)."""
    message: str = ""
    """The line(s) that name the fault, as printed."""
    went_on: bool = False
    """The run trained on past the fault (as against stopping)."""
    seconds: float | None = None
    """Fault to the run going on again (the faulty part back or contained), or fault to
    the last process of the run gone when it stopped."""
    held_up_s: float | None = None
    """The longest the learner went without a step from the fault on."""
    steps_done: int = 0
    """Steps trained when the run stopped (all attempts)."""
    checkpoint: int | None = None
    """The step of the checkpoint a resume starts from."""
    skipped: list[dict] = field(default_factory=list)
    """Prompts given up on, by id (``skipped_prompts.jsonl``)."""
    leftovers: list[str] = field(default_factory=list)
    """Processes of the run alive after its launcher exited (or after the stop)."""
    resumed_from: int | None = None
    """The checkpoint step the next ``--resume`` started from (None: not resumed)."""
    resumed: int | None = None
    """The exit status of the ``--resume`` that completed the run (None: not resumed)."""
    notes: dict[str, object] = field(default_factory=dict)
    """Figures of this fault (reward errors, aim failures, log growth ...)."""

    @property
    def lost_steps(self) -> int | None:
        """Trained steps that the checkpoint a resume starts from does not hold."""
        return None if self.checkpoint is None else self.steps_done - self.checkpoint


def metric(launch: Launch, name: str) -> float:
    """The latest value of a metric (0 before any step carries it)."""
    for record in reversed(launch.metrics()):
        if record.get(name) is not None:
            return record[name]
    return 0.0


def metric_reaches(launch: Launch, name: str, value: float) -> Callable[[], bool]:
    return lambda: metric(launch, name) >= value


def lines_with(text: str, *words: str) -> str:
    """The lines of ``text`` holding any of ``words`` (case-insensitive)."""
    lines = [line for line in text.splitlines() if any(w.lower() in line.lower() for w in words)]
    return "\n".join(lines)


# -------------------------------------------------------------------------- mounts


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise MountUnavailable(f"mount {' '.join(args)}: {result.stderr.strip()}")


def _umount(path: Path) -> None:
    """Unmount; lazily when a process still holds a file there (it is then detached)."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def can_mount() -> str | None:
    """None when this process may mount (root); else why not, for a skip reason."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root (CI and the dev machine run as root)"
    return None


@contextlib.contextmanager
def small_disk(path: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` MiB at ``path``, unmounted on the way out."""
    if (why := can_mount()) is not None:
        raise MountUnavailable(why)
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


@contextlib.contextmanager
def read_only_disk(path: Path) -> Iterator[Path]:
    """An empty read-only tmpfs at ``path`` (unwritable even for root)."""
    if (why := can_mount()) is not None:
        raise MountUnavailable(why)
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)


REMOUNT_TRIES = 400
"""Linux refuses a read-only remount ("mount point is busy") while a file under it is open
for writing; aim closes its files between writes, so the remount is tried again (every
50 ms, for 20 s: on a busy machine aim's writes can keep a file open for seconds)."""


def _remount_read_only(path: Path) -> None:
    for _ in range(REMOUNT_TRIES - 1):
        with contextlib.suppress(MountUnavailable):
            return _mount("-o", "remount,bind,ro", str(path))
        time.sleep(0.05)
    _mount("-o", "remount,bind,ro", str(path))


@contextlib.contextmanager
def made_read_only(path: Path) -> Iterator[Callable[[], None]]:
    """Yields a function that turns the directory ``path`` read-only where it is (a bind
    mount of itself, remounted ``ro``), as a filesystem that fails under a running
    process would; unmounted on the way out."""
    mounted = False

    def make() -> None:
        nonlocal mounted
        if (why := can_mount()) is not None:
            raise MountUnavailable(why)
        _mount("--bind", str(path), str(path))
        mounted = True
        _remount_read_only(path)

    try:
        yield make
    finally:
        if mounted:
            _umount(path)


class Filler:
    """Takes every free byte of a filesystem and, until stopped, every byte freed later,
    as another process filling the disk would (a disk that stays full, not one that a
    deleted file makes room on again). Its file is removed on the way out."""

    def __init__(self, directory: Path):
        self.path = directory / "filler"
        self.written = 0
        self.full = threading.Event()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._fill, daemon=True)

    def __enter__(self) -> Filler:
        self.thread.start()
        assert self.full.wait(timeout=60), "the disk never filled"
        return self

    def __exit__(self, *_) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.path.unlink(missing_ok=True)

    def _fill(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while not self.stopping.is_set():
                self._write_until_full(fd)
                self.full.set()
                self.stopping.wait(0.02)
        finally:
            os.close(fd)

    def _write_until_full(self, fd: int) -> None:
        for size in (1 << 20, 1 << 12):  # a tmpfs page last: the last one free is taken too
            block = b"\0" * size
            try:
                while True:
                    self.written += os.write(fd, block)
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise


# ---------------------------------------------------------------- planted faults

REWARD_FILE = '''
"""A user's reward function (digits) that misbehaves once per trigger file in TRIGGERS:
``hang`` sleeps for an hour, ``crash`` exits its process, ``flood`` prints 64 MiB."""
import os
import sys
import time

from asyncrl.generation.tasks import digits_score

TRIGGERS = {triggers!r}
FLOOD_MB = 64


def claim(name):
    """True for the one caller that takes the trigger ``name`` (and note when)."""
    try:
        os.rename(os.path.join(TRIGGERS, name), os.path.join(TRIGGERS, name + ".taken"))
    except FileNotFoundError:
        return False
    with open(os.path.join(TRIGGERS, name + ".at"), "w") as record:
        record.write(repr(time.time()))
    return True


def score(data_source, solution_str, ground_truth, extra_info=None):
    if claim("hang"):
        time.sleep(3600)
    if claim("crash"):
        os._exit(3)
    if claim("flood"):
        line = "flood " * 170 + "\\n"
        for _ in range(FLOOD_MB * 1024):
            sys.stdout.write(line)
        sys.stdout.flush()
    return digits_score(data_source, solution_str, ground_truth, extra_info)
'''


def reward_file(directory: Path) -> tuple[Path, Path]:
    """A reward function file and its trigger directory (see :data:`REWARD_FILE`)."""
    triggers = directory / "triggers"
    triggers.mkdir(parents=True, exist_ok=True)
    path = directory / "misbehaving_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE.format(triggers=str(triggers))))
    return path, triggers


def arm(triggers: Path, name: str) -> None:
    (triggers / name).touch()


def claimed_at(triggers: Path, name: str) -> float | None:
    """When a reward worker took the trigger ``name`` (``time.time()``), None before."""
    path = triggers / f"{name}.at"
    with contextlib.suppress(OSError, ValueError):
        return float(path.read_text())
    return None


HF_BACKEND_HOOK = '''

import importlib.abc
import importlib.util
import sys


class _Patch(importlib.abc.MetaPathFinder):
    """Calls the site's ``patch(HFBackend)`` as soon as the HF backend's module is loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "asyncrl.generators.hf_backend":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patch(module.HFBackend)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get(TRIGGER_VARIABLE):
    sys.meta_path.insert(0, _Patch())
'''


def plant_site(directory: Path, site: str, trigger_variable: str) -> str:
    """Write ``site`` (its ``patch(HFBackend)``, then :data:`HF_BACKEND_HOOK`) as the
    ``sitecustomize`` of ``directory/site``, active where ``trigger_variable`` is set;
    returns the ``PYTHONPATH`` that plants it in every process of a launch."""
    folder = directory / "site"
    folder.mkdir(parents=True, exist_ok=True)
    hook = HF_BACKEND_HOOK.replace("TRIGGER_VARIABLE", repr(trigger_variable))
    (folder / "sitecustomize.py").write_text(site + hook)
    return os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)


SLOW_CHUNK_SITE = '''
"""Planted by tests/integration/fault_harness.py: one engine call of one generator sleeps
ASYNCRL_FAULT_SLOW_CHUNK_S seconds once the file ASYNCRL_FAULT_SLOW_CHUNK exists."""
import json
import os
import time


def _slowed(generate_chunk):
    trigger = os.environ["ASYNCRL_FAULT_SLOW_CHUNK"]
    seconds = float(os.environ["ASYNCRL_FAULT_SLOW_CHUNK_S"])

    def generate_chunk_slowly(self, rollouts, max_tokens):
        try:
            os.rename(trigger, trigger + ".taken")
        except FileNotFoundError:
            return generate_chunk(self, rollouts, max_tokens)
        began = time.time()
        time.sleep(seconds)
        result = generate_chunk(self, rollouts, max_tokens)
        record = {"pid": os.getpid(), "began": began, "ended": time.time()}
        with open(trigger + ".json", "w") as out:
            json.dump(record, out)
        return result

    return generate_chunk_slowly


def patch(backend):
    backend.generate_chunk = _slowed(backend.generate_chunk)
'''


def slow_chunk_env(directory: Path, seconds: float) -> tuple[dict[str, str], Path]:
    """The environment that plants a slow chunk (see :data:`SLOW_CHUNK_SITE`) and the
    trigger file to create when it should happen; ``TRIGGER.json`` records it."""
    trigger = directory / "slow-chunk"
    env = {
        "PYTHONPATH": plant_site(directory, SLOW_CHUNK_SITE, "ASYNCRL_FAULT_SLOW_CHUNK"),
        "ASYNCRL_FAULT_SLOW_CHUNK": str(trigger),
        "ASYNCRL_FAULT_SLOW_CHUNK_S": str(seconds),
    }
    return env, trigger


def slow_chunk_record(trigger: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(Path(f"{trigger}.json").read_text())
    return None


KEEP_BASE_SITE = '''
"""Planted by tests/integration/fault_harness.py: the first generator to load LoRA adapters
once the file ASYNCRL_FAULT_KEEP_BASE exists never applies any: it drops every version's
adapters and says it loaded them (its engine keeps the base model)."""
import os

broken = []


def _claimed():
    if not broken:
        trigger = os.environ["ASYNCRL_FAULT_KEEP_BASE"]
        try:
            os.rename(trigger, trigger + ".taken")
            broken.append(os.getpid())
        except FileNotFoundError:
            broken.append(None)
    return broken[0] is not None


def _dropping(load_in_parts):
    def load_weights_in_parts(self, names, parts, version):
        if self.adapter_digest is None or not _claimed():
            return load_in_parts(self, names, parts, version)
        for _ in parts:
            pass
        self.version = version  # and the adapter digest, read back, stays the base's

    return load_weights_in_parts


def patch(backend):
    backend.load_weights_in_parts = _dropping(backend.load_weights_in_parts)
    backend.weight_buffers = lambda self, buckets: None  # every path loads in parts
'''


def keep_base_env(directory: Path) -> tuple[dict[str, str], Path]:
    """The environment that plants a replica keeping the base model (see
    :data:`KEEP_BASE_SITE`), and the trigger file; ``TRIGGER.taken`` once one took it."""
    path = plant_site(directory, KEEP_BASE_SITE, "ASYNCRL_FAULT_KEEP_BASE")
    trigger = directory / "keep-base"
    trigger.touch()
    return {"PYTHONPATH": path, "ASYNCRL_FAULT_KEEP_BASE": str(trigger)}, trigger


def file_size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0


# ----------------------------------------------------------------------- scenarios
# Each runs to its end and leaves no process behind (``Launch.kill`` in a finally).
# A failed expectation raises AssertionError naming what did not happen.

SLOW_CHUNK_S = 5.0
"""Longer than the heartbeat timeout (3 s), shorter than run.stall_timeout_s (10 s)."""
REWARD_TIMEOUT_S = 2.0


def settle(launch: Launch, steps: int = 2) -> None:
    """A few more steps: the run trains on."""
    launch.wait_for_new_steps(launch.new_steps() + steps)


def stopped_cleanly(launch: Launch, *cases: Case) -> None:
    """SIGTERM to the launcher; its status, the leftovers and what was skipped, into ``cases``."""
    status = launch.stop()
    for case in cases:
        case.status = status
        case.steps_done = launch.trained_to()
        case.checkpoint = checkpoint_step(launch.run_dir)
        case.skipped = skipped_prompts(launch.run_dir)
        case.leftovers = launch.leftovers()


def killed_generator(work: Path) -> Case:
    """kill -9 of generator-0 after step 3; the run trains on, then stops on SIGTERM.
    (``test_supervision.py`` backs this row; the table's figures come from here.)"""
    run = start(work / "killed-generator", LONG)
    case = Case("kill -9 of a generator")
    try:
        run.wait_for_step(3)
        fault = time.time()
        run.role("generator", index=0).kill()
        back = run.until("the restarted generator-0's samples", restarts(run, 1))
        case.seconds, case.held_up_s = back - fault, run.held_up_s(fault, back)
        case.message = lines_with(run.stderr(), "generator-0")
        case.went_on = True
        stopped_cleanly(run, case)
        case.notes["ledger"] = final_ledger(run.run_dir)
    finally:
        run.kill()
    return case


def suspend_generator(run: Launch, case: Case) -> None:
    """SIGSTOP generator-1: its heartbeats stop with it (the buffer hands its groups out
    again) and so does its progress (the watchdog replaces it after run.stall_timeout_s)."""
    victim = run.role("generator", index=1)
    before = metric(run, "generators_restarts_total")
    fault = time.time()
    victim.suspend()
    replaced = restarts(run, before + 1)
    back = run.until("the replaced generator-1's samples", replaced, STALL_S + 90)
    case.seconds, case.held_up_s = back - fault, run.held_up_s(fault, back)
    case.message = lines_with(run.stderr(), "generator-1")
    case.went_on = True
    case.notes["suspended process"] = victim


def restarts(launch: Launch, count: int) -> Callable[[], bool]:
    """True once a step carried samples of a replica restarted ``count`` times in all."""
    return metric_reaches(launch, "generators_restarts_total", count)


def final_ledger(run_dir: Path) -> Ledger:
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None, f"no complete checkpoint in {run_dir}"
    return ledger(run_dir, checkpoint)


def contained_faults(work: Path) -> dict[str, Case]:
    """In one run with aim on, one after the other: a reward function that hangs, one that
    exits its process, one that prints 64 MiB; a generator chunk slowed past the heartbeat
    timeout; aim's repository turned read-only; a generator stopped with SIGSTOP. Each is
    contained and the run trains on; it stops on SIGTERM."""
    reward, triggers = reward_file(work)
    env, slow = slow_chunk_env(work, SLOW_CHUNK_S)
    run_dir = work / "contained"
    overrides = (LONG, "tracking.aim=true", f"reward.function={reward}:score",
                 f"reward.timeout_s={REWARD_TIMEOUT_S:g}")  # fmt: skip
    cases = {name: Case(fault) for name, fault in CONTAINED.items()}
    run = start(run_dir, *overrides, env=env)
    try:
        run.wait_for_step(3)
        with made_read_only(run_dir / ".aim") as make_read_only:
            for name, errors in (("hang", 1), ("crash", 2)):
                reward_fault(run, triggers, name, errors, cases[f"reward-{name}"])
            reward_flood(run, triggers, cases["reward-flood"])
            slow_chunk_over(run, slow, cases["slow-chunk"])
            aim_fault = break_aim(make_read_only, cases["tracker"])
            aim_failed(run, aim_fault, cases["tracker"])
            suspend_generator(run, cases["generator-stop"])
            stopped_cleanly(run, *cases.values())
        suspended = cases["generator-stop"].notes.pop("suspended process")
        cases["generator-stop"].notes["suspended process gone"] = not alive(suspended)
        note_contained(run, cases)
    finally:
        run.kill()
    return cases


def break_aim(make_read_only: Callable[[], None], case: Case) -> float:
    """Turn aim's repository read-only (as root); when that was."""
    if (why := can_mount()) is None:
        try:
            make_read_only()
        except MountUnavailable as error:  # aim kept a file open for writing throughout
            why = str(error)
    if why is not None:
        case.notes["not run"] = why
    return time.time()


def aim_failed(run: Launch, since: float, case: Case) -> None:
    """Wait until the learner counted aim's failure (it goes on without aim)."""
    case.went_on = True
    if "not run" in case.notes:
        return
    failed = run.until("aim's failure", metric_reaches(run, "tracking_aim_failures_total", 1))
    case.seconds, case.held_up_s = failed - since, run.held_up_s(since, failed)
    case.message = lines_with(log(run.run_dir, "learner"), "asyncrl.tracking")


def slow_chunk_over(run: Launch, trigger: Path, case: Case) -> None:
    """Slow the next chunk; wait until it ended and two more steps; what it cost the run."""
    counters = ("buffer_dropped_stale", "buffer_generators_replaced", "generators_restarts_total")
    before = {name: metric(run, name) for name in counters}
    trigger.touch()
    run.until("the slow chunk's end", lambda: slow_chunk_record(trigger) is not None)
    record = slow_chunk_record(trigger) or {}
    settle(run)
    case.seconds = record["ended"] - record["began"]
    case.held_up_s, case.went_on = run.held_up_s(record["began"], time.time()), True
    after = {name: metric(run, name) - before[name] for name in counters}
    case.notes |= {
        "dropped stale samples": after["buffer_dropped_stale"],
        "generators replaced by the buffer": after["buffer_generators_replaced"],
        "generators restarted": after["generators_restarts_total"],
    }


CONTAINED = {
    "reward-hang": "a reward function that hangs",
    "reward-crash": "a reward function that crashes (exits its process)",
    "reward-flood": "a reward function that floods its output (64 MiB)",
    "slow-chunk": f"a slow chunk ({SLOW_CHUNK_S:g} s engine call)",
    "tracker": "a tracker that fails (aim's repository turns read-only)",
    "generator-stop": "SIGSTOP of a generator (past the heartbeat timeout)",
}


def log(run_dir: Path, name: str) -> str:
    path = run_dir / "logs" / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def generator_logs_bytes(run_dir: Path) -> int:
    return sum(file_size(path) for path in (run_dir / "logs").glob("generator-*.log"))


def reward_fault(run: Launch, triggers: Path, name: str, errors: int, case: Case) -> None:
    """Arm the reward trigger ``name``; wait until its sample's error is counted."""
    arm(triggers, name)
    done = run.until(f"the reward {name}'s error", metric_reaches(
        run, "generators_reward_errors_total", errors))  # fmt: skip
    began = claimed_at(triggers, name)
    assert began is not None, f"the {name} trigger was never taken"
    case.seconds, case.held_up_s, case.went_on = done - began, run.held_up_s(began, done), True
    case.notes["reward errors"] = metric(run, "generators_reward_errors_total")
    case.message = lines_with(generator_logs(run.run_dir), "error:timeout" if name == "hang"
                              else "error:crashed")  # fmt: skip


def generator_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("generator-*"))


def reward_flood(run: Launch, triggers: Path, case: Case) -> None:
    """Arm the flood; wait until it was printed and two more steps were trained."""
    before = generator_logs_bytes(run.run_dir)
    arm(triggers, "flood")
    noted = run.until("the flood's excerpt", lambda: FLOOD_NOTE in generator_logs(run.run_dir))
    began = claimed_at(triggers, "flood")
    assert began is not None, "the flood trigger was never taken"
    settle(run)
    case.seconds, case.went_on = noted - began, True
    case.held_up_s = run.held_up_s(began, time.time())
    case.notes["log growth bytes"] = generator_logs_bytes(run.run_dir) - before
    case.message = lines_with(generator_logs(run.run_dir), FLOOD_NOTE)


FLOOD_NOTE = "not shown"
"""In the generator's line on a reward worker's output: ``printed N bytes, M not shown``."""


def note_contained(run: Launch, cases: dict[str, Case]) -> None:
    """The run's figures that tell what the contained faults cost."""
    cases["tracker"].notes["aim failures"] = metric(run, "tracking_aim_failures_total")
    ledger_now = final_ledger(run.run_dir)
    for case in cases.values():
        case.notes["ledger"] = ledger_now


def stopping_faults(work: Path, size_mb: int = 64, extra: tuple[str, ...] = ()) -> dict[str, Case]:
    """One run, aim on (the quickstart's default), checkpoints every 4 steps, on a small
    tmpfs: kill -9 of learner rank 1 of 2, resume on one rank (DCP reshards); kill -9 of
    the launcher, resume; the disk kept full to its last page, then freed, resume to
    the end. Without root (no tmpfs) it runs in a plain directory, without the disk fault.
    ``extra``: more overrides of the run (every resume keeps them: they are its config)."""
    cases = {
        "learner-rank": Case("kill -9 of a learner rank (rank 1 of 2)"),
        "launcher": Case("kill -9 of the launcher"),
        "disk": Case("disk full (the run directory's filesystem; aim on)"),
    }
    outputs = work / "launches"
    with maybe_small_disk(work / "disk", size_mb) as why:
        run_dir = work / "disk" / "run"
        overrides = (LONG, "tracking.aim=true", "learner.world_size=2",
                     f"learner.checkpoint_every={EVERY}", *extra)  # fmt: skip
        run = start(run_dir, *overrides, logs=outputs)
        kill_role(run, cases["learner-rank"], 6, lambda: run.role("learner", rank=1))
        run = resume(run_dir, "learner.world_size=1", logs=outputs)
        kill_launcher(run, cases["launcher"], cases["learner-rank"])
        last = cases["launcher"]
        if why is None:
            fill_the_disk(resume(run_dir, logs=outputs), cases["disk"], last)
            last = cases["disk"]
        else:
            del cases["disk"]
        resume_to_the_end(run_dir, last, list(cases.values()), outputs)
    return cases


EVERY = 4
"""learner.checkpoint_every of the runs that stop."""


@contextlib.contextmanager
def maybe_small_disk(path: Path, size_mb: int) -> Iterator[str | None]:
    """A tmpfs at ``path`` (None) or, where none can be mounted, a plain directory (why)."""
    with contextlib.ExitStack() as stack:
        why = None
        try:
            stack.enter_context(small_disk(path, size_mb))
        except MountUnavailable as error:
            path.mkdir(parents=True, exist_ok=True)
            why = str(error)
        yield why


def resume_to_the_end(run_dir: Path, last: Case, cases: list[Case], outputs: Path) -> None:
    """Resume to the checkpoint after ``last``'s; each case gets the exit status and the
    prompts' ledger at that final checkpoint."""
    total = ((last.checkpoint or 0) // EVERY + 1) * EVERY  # a checkpoint at the last step
    run = resume(run_dir, f"run.total_steps={total}", logs=outputs)
    try:
        status = run.wait()
        last.resumed_from = resumed_from(run)
    finally:
        run.kill()
    finished = final_ledger(run_dir) if status == 0 else None
    refused = max((r.get("buffer_refused_adapter") or 0.0 for r in run.metrics()), default=0.0)
    for case in cases:
        case.resumed = status
        case.notes["ledger"] = finished
        case.notes["final step"] = run.trained_to()
        case.notes["adapter samples refused"] = refused  # of every launch of the run


def kill_role(
    run: Launch,
    case: Case,
    after: int,
    victim: Callable[[], psutil.Process],
    previous: Case | None = None,
) -> None:
    """After ``after`` steps of this launch, kill -9 ``victim()``; the launcher's answer.
    This launch resumed the run after ``previous``: where from goes into that case."""
    try:
        run.wait_for_new_steps(after)
        if previous is not None:
            previous.resumed_from = resumed_from(run)
        fault = time.time()
        victim().kill()
        stopped(run, case, fault)
    finally:
        run.kill()


def stopped(run: Launch, case: Case, fault: float) -> None:
    """Wait for the launcher's exit after ``fault``; what it said, lost and left."""
    case.status = run.wait()
    case.notes["exits after s"] = exit_delays(run, fault)
    case.leftovers = run.leftovers()
    case.seconds = (run.ended or time.time()) - fault
    case.message = lines_with(run.stderr(), "run failed", "continue the run", "cannot be",
                              "No space")  # fmt: skip
    case.notes["stderr"] = run.stderr()[-3000:]  # what the user saw
    case.steps_done = run.trained_to()
    case.checkpoint = checkpoint_step(run.run_dir)
    case.skipped = skipped_prompts(run.run_dir)


def exit_delays(launch: Launch, since: float) -> dict[str, float]:
    """Seconds from ``since`` until the last process of each role that was running then
    had exited (a role with a process still running is left out)."""
    delays: dict[str, float] = {}
    for pid, role in sorted(launch.roles.items(), key=lambda item: item[1]):
        exited = launch.exits.get(pid, float("inf"))
        if exited > since:
            delays[role] = max(delays.get(role, 0.0), round(exited - since, 1))
    return {role: delay for role, delay in delays.items() if delay != float("inf")}


def kill_launcher(run: Launch, case: Case, previous: Case) -> None:
    """After 3 steps of this launch, kill -9 the launcher; wait for its processes to go.
    This launch resumed the run after ``previous``: where from goes into that case."""
    try:
        run.wait_for_new_steps(3)
        previous.resumed_from = resumed_from(run)
        for process in run.tree():
            run.note(process)
        fault = time.time()
        run.process.kill()
        case.seconds = gone(run) - fault
        case.notes["exits after s"] = exit_delays(run, fault)
        case.leftovers = run.leftovers()
        case.message = lines_with(log(run.run_dir, "learner"), "signal", "checkpoint", "buffer")
        case.steps_done = run.trained_to()
        case.checkpoint = checkpoint_step(run.run_dir)
        case.skipped = skipped_prompts(run.run_dir)
    finally:
        run.kill()


def fill_the_disk(run: Launch, case: Case, previous: Case) -> None:
    """After 3 steps of this launch, fill the run directory's disk and keep it full until
    the launcher exits; the launcher's answer. Then the space is freed (as an operator
    would, before resuming)."""
    try:
        run.wait_for_new_steps(3)
        previous.resumed_from = resumed_from(run)
        with Filler(run.run_dir.parent) as filler:
            fault = time.time()
            stopped(run, case, fault)
            case.notes["filler bytes"] = filler.written
    finally:
        run.kill()


def killed_buffer(work: Path) -> Case:
    """kill -9 of the buffer after step 6, then resume to the end.
    (``test_buffer_death.py`` backs this row; the table's figures come from here.)"""
    run_dir = work / "killed-buffer"
    case = Case("kill -9 of the buffer")
    run = start(run_dir, LONG, f"learner.checkpoint_every={EVERY}")
    kill_role(run, case, 6, lambda: run.role("buffer"))
    resume_to_the_end(run_dir, case, [case], work / "launches")
    return case


def unwritable_run_dir(work: Path) -> Case:
    """``--run-dir`` on a read-only filesystem (as root; a directory of mode 0500 else)."""
    case = Case("an unwritable run directory")
    outputs = work / "launches"
    with unwritable(work / "unwritable") as parent:
        run = start(parent / "run", "run.total_steps=5", logs=outputs)
        try:
            case.status = run.wait(60)
            case.seconds = (run.ended or time.time()) - run.started
            case.leftovers = run.leftovers()
            case.message = run.stderr().strip()
            case.notes["stdout"] = run.stdout().strip()
            case.notes["created"] = (parent / "run").exists()
            case.notes["run dir"] = str(parent / "run")
        finally:
            run.kill()
    return case


@contextlib.contextmanager
def unwritable(path: Path) -> Iterator[Path]:
    """A directory this process cannot write in: a read-only tmpfs as root, mode 0500 else."""
    if os.geteuid() != 0:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o500)
        try:
            yield path
        finally:
            path.chmod(0o700)
        return
    with read_only_disk(path):
        yield path
