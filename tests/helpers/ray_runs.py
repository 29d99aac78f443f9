"""Ray stand-ins (a fake ray module, its task error, a console that records), a private
RAY_TMPDIR, and the checks that a Ray run left nothing behind.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil

REPO = Path(__file__).resolve().parents[2]


QUICKSTART = REPO / "configs/quickstart.yaml"


class FakeTaskError(Exception):
    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class FakeRef:
    """A task's result: pending until the test finishes it."""

    def __init__(self, value: object = None, done: bool = False):
        self.value, self.error, self.done = value, None, done

    def finish(self, error: BaseException | None = None) -> None:
        self.error, self.done = error, True


class FakeActor:
    def __init__(self, ray: FakeRay):
        info = {"ip": "10.0.0.9", "node_id": "abcdef12", "pid": 4242}
        self.start = SimpleNamespace(remote=lambda *args: FakeRef(info, done=True))
        self.free_ports = SimpleNamespace(
            remote=lambda host, count: FakeRef(list(range(41000, 41000 + count)), done=True)
        )
        self.run = SimpleNamespace(
            remote=lambda argv, env, credentials: ray.started(self, argv, credentials)
        )


class FakeRay:
    """What RayRun calls of ray, with each role's task finished by ``script``."""

    exceptions = SimpleNamespace(RayError=FakeTaskError, RayTaskError=FakeTaskError)

    def __init__(self, script: Callable[[FakeRay], None]):
        self.script = script
        self.runs: list[tuple[FakeActor, list[str], FakeRef]] = []
        self.killed: list[FakeActor] = []
        self.handed: list[tuple[list[str], str | None]] = []
        """Each role run's argv and the credentials handed with the call."""

    def started(self, actor: FakeActor, argv: list[str], credentials: str | None) -> FakeRef:
        self.runs.append((actor, argv, FakeRef()))
        self.handed.append((argv, credentials))
        return self.runs[-1][2]

    def run_of(self, name: str, restarts: int = 0) -> FakeRef:
        """The role ``name`` (buffer, learner, generator-0) ran with ``--restarts``."""
        for _, argv, ref in self.runs:
            restarted = int(argv[argv.index("--restarts") + 1]) if "--restarts" in argv else 0
            if argv[0] == name.split("-")[0] and restarted == restarts:
                return ref
        raise LookupError(f"{name} was not run with --restarts {restarts}")

    def remote(self, cls: type) -> SimpleNamespace:
        actors = SimpleNamespace(remote=lambda: FakeActor(self))
        return SimpleNamespace(options=lambda **options: actors)

    def wait(self, refs: list[FakeRef], num_returns: int = 1, timeout: float = 0):
        if self.runs:  # the roles have started (not while placing the actors)
            self.script(self)
        time.sleep(0.01)
        done = [ref for ref in refs if ref.done][:num_returns]
        return done, [ref for ref in refs if ref not in done]

    def get(self, refs: FakeRef | list[FakeRef]) -> object:
        if isinstance(refs, list):
            return [self.get(ref) for ref in refs]
        if refs.error is not None:
            raise refs.error
        return refs.value

    def kill(self, actor: FakeActor) -> None:
        self.killed.append(actor)


class RecordingConsole:
    def __init__(self) -> None:
        self.notes: list[str] = []
        self.states: list[tuple[str, int]] = []

    def note(self, message: str, error: bool = False) -> None:
        self.notes.append(message)

    def update(self, health: list) -> None:
        for replica in health:
            if replica.name == "generator-0" and (replica.state, replica.restarts) not in (
                self.states[-1:] or [None]
            ):
                self.states.append((replica.state, replica.restarts))


@contextlib.contextmanager
def ray_temp_dir() -> Iterator[Path]:
    """A short, private RAY_TMPDIR (Ray's socket paths must stay short), so every Ray
    process of one test can be told apart from other Ray instances on the machine."""
    path = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def processes_of(ray_dir: Path, run_dir: Path) -> list[psutil.Process]:
    """Live processes of this test's Ray: its daemons name the temp dir, its workers
    (renamed ``ray::...``) inherited it in their environment."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmdline = " ".join(process.info["cmdline"] or [])
        with contextlib.suppress(psutil.Error):
            named = str(ray_dir) in cmdline or str(run_dir) in cmdline
            if named or process.environ().get("RAY_TMPDIR") == str(ray_dir):
                found.append(process)
    return found


def assert_nothing_left(ray_dir: Path, run_dir: Path) -> None:
    deadline = time.monotonic() + 10  # the driver has exited; give init a moment to reap
    while (left := processes_of(ray_dir, run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for process in left:  # ours (found by our temp dir): do not leak them into other tests
        with contextlib.suppress(psutil.Error):
            process.kill()
    assert left == [], [p.info["cmdline"] for p in left]


def actor_process(log_path: Path, ray_dir: Path) -> psutil.Process:
    """The process of the actor that last started writing ``log_path`` (each actor says
    its pid there), checked to belong to this test's Ray."""
    pids = re.findall(r"asyncrl: ray actor [\w-]+: pid (\d+) on node", log_path.read_text())
    assert pids, f"no actor pid in {log_path}"
    process = psutil.Process(int(pids[-1]))
    assert process.environ().get("RAY_TMPDIR") == str(ray_dir), process.cmdline()
    return process
