"""Nothing hangs silently: a role that stops making progress, or a generator that can never
start, stops the run with a message that names it (and the resume command).

- On a scripted Ray (``test_ray.FakeRay``, fast): the Ray driver's supervision does what
  the local launcher's does.
- With `asyncrl launch` on the quickstart (slow): the learner or the buffer frozen with
  SIGSTOP for ``run.stall_timeout_s``, and a generator whose reward function cannot load
  in a generator process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.core.paths import latest_checkpoint
from asyncrl.core.stop_signals import StopSignals
from asyncrl.run.ray.run import RayRun
from asyncrl.run.status import read_metrics
from asyncrl.run.watchdog import START_FAILURES, START_TIMEOUT_S, Watchdog
from tests.helpers.ray_runs import QUICKSTART, FakeRay, FakeTaskError, RecordingConsole
from tests.helpers.run_processes import processes_of

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------ on a scripted Ray


def write_report(run_dir: Path, name: str, pid: int, advances: int, doing: str) -> None:
    """A report as the role in process ``pid`` would write it."""
    now = time.time()
    report = {
        "name": name, "role": name.split("-")[0], "pid": pid, "host": "here", "started": now,
        "doing": doing, "detail": "", "since": now, "advances": advances, "advanced_at": now,
        "beat_at": now, "patience_s": 0.0, "waiting_for": "",
    }  # fmt: skip
    path = run_dir / "progress" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ray_run(tmp_path: Path, script, *overrides: str) -> tuple[RayRun, FakeRay, Clock]:
    """The quickstart (one generator) on a scripted Ray, its watchdog on a clock the test
    moves, each generator restart after 10 ms; the roles started."""
    config = load_config(QUICKSTART, ["cluster.backend=ray", "generators.replicas=1", *overrides])
    ray, clock = FakeRay(script), Clock()
    (tmp_path / "logs").mkdir()
    run = RayRun(ray, config, tmp_path, None, StopSignals())
    run.watchdog = Watchdog(tmp_path, config.run.stall_timeout_s, clock=clock)
    run.create_actors()
    for member in run.members:
        if member.replica is not None:
            member.replica.backoff_s = 0.01
    run.run_roles()
    return run, ray, clock


def test_ray_a_generator_failing_the_same_way_at_every_start_fails_the_run(tmp_path):
    def script(ray: FakeRay) -> None:  # every generator's role raises at once
        for _, argv, ref in ray.runs:
            if argv[0] == "generator" and not ref.done:
                ref.finish(FakeTaskError(RuntimeError("no reward function here")))

    run, ray, _ = ray_run(tmp_path, script)
    console = RecordingConsole()
    failure = run.supervise(console)
    generators = [argv for _, argv, _ in ray.runs if argv[0] == "generator"]
    assert len(generators) == START_FAILURES
    assert failure == (
        "actor generator-0 on 10.0.0.9: failed 3 times in a row before making any progress, "
        "each time with: RuntimeError: no reward function here; last lines of "
        f"{tmp_path / 'logs' / 'generator-0.log'}:\n"
        "    ---- asyncrl launch: restart 1 ----\n"
        "    ---- asyncrl launch: restart 2 ----\n"
        "what the other actors last reported:\n"
        "    buffer: no progress report\n"
        "    learner: no progress report"
    )


def test_ray_a_stalled_generator_actor_is_killed_and_replaced(tmp_path):
    def script(ray: FakeRay) -> None:
        clock.now = max(clock.now, START_TIMEOUT_S)  # the first actor never started
        for actor, _, ref in ray.runs:
            if actor in ray.killed and not ref.done:  # the kill ends its role's task
                ref.finish(FakeTaskError(RuntimeError("the actor died")))
        with contextlib.suppress(LookupError):
            ray.run_of("generator-0", restarts=1)
            ray.run_of("learner").finish()

    run, ray, clock = ray_run(tmp_path, script, "run.stall_timeout_s=10")
    for name in ("buffer", "learner"):  # only the generator is left to stall here
        run.watchdog.forget(name)
    console = RecordingConsole()
    assert run.supervise(console) is None
    first = ray.runs[2][0]
    assert ray.killed[0] is first
    killed, stopped, again = console.notes
    assert killed == (
        "asyncrl: generator-0 (pid 4242) stalled: no progress report in 300s since it started "
        "(run.stall_timeout_s=10; 300s allowed to start); killing its actor"
    )
    assert "stopped after" in stopped and "restarting it in 0s" in stopped
    assert again == "asyncrl: generator-0 started again (restart 1) on 10.0.0.9"
    assert run.members[2].replica.failures.count == 1  # it stalled while starting


def test_ray_a_stalled_learner_fails_the_run_naming_it(tmp_path):
    def script(ray: FakeRay) -> None:
        clock.now = 10.0

    run, _, clock = ray_run(tmp_path, script, "run.stall_timeout_s=10")
    run.watchdog.forget("buffer")
    write_report(tmp_path, "learner", 4242, 3, doing="waiting for a batch for step 2")
    write_report(tmp_path, "generator-0", 4242, 5, doing="generating")
    failure = run.supervise(RecordingConsole())
    head, others, generator = failure.splitlines()
    assert head.startswith(
        "learner (pid 4242) stalled: no progress for 10s (run.stall_timeout_s=10); since "
    )
    assert head.endswith(" it has been waiting for a batch for step 2")
    assert others == "what the other actors last reported:"
    assert generator.startswith("    generator-0: generating since ")


def test_ray_a_fault_of_the_driver_while_supervising_stops_the_run_and_says_so(
    tmp_path, monkeypatch
):
    from asyncrl.run.ray import cluster as ray_cluster

    def broken(run, console):
        raise RuntimeError("a tick went wrong")

    console, stopped = RecordingConsole(), []
    config = load_config(QUICKSTART, ["cluster.backend=ray"])
    monkeypatch.setattr(ray_cluster, "_connect", lambda config: SimpleNamespace(shutdown=dict))
    monkeypatch.setattr(
        "asyncrl.run.console.open_console", lambda *a: contextlib.nullcontext(console)
    )
    monkeypatch.setattr(RayRun, "start", broken)
    monkeypatch.setattr(RayRun, "stop", lambda run: stopped.append(True))
    monkeypatch.setattr(RayRun, "health", lambda run: [])
    assert ray_cluster.launch_ray(config, tmp_path) == 1
    assert stopped == [True]
    trace, closing = console.notes[-2:]
    assert 'raise RuntimeError("a tick went wrong")' in trace
    assert closing.startswith(
        "asyncrl: run failed: the launcher failed while supervising: "
        "RuntimeError('a tick went wrong')"
    )


# ------------------------------------------------------------ end to end

COMMON = ("tracking.aim=false", "buffer.heartbeat_timeout_s=3", "generators.replicas=1")


class Launch:
    """`asyncrl launch --quiet` on the quickstart in the background, its output in files."""

    def __init__(self, tmp_path: Path, *overrides: str):
        self.run_dir = tmp_path / "run"
        self.err = tmp_path / "launch.err"
        command = [
            sys.executable, "-m", "asyncrl", "launch", "--quiet", str(QUICKSTART), *COMMON,
            *overrides, "--run-dir", str(self.run_dir),
        ]  # fmt: skip
        with (tmp_path / "launch.out").open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=err, cwd=REPO, start_new_session=True
            )

    def stderr(self) -> str:
        return self.err.read_text()

    def role(self, role: str) -> psutil.Process:
        (found,) = [p for p in processes_of(self.run_dir) if p.cmdline()[3:4] == [role]]
        return found

    def wait_for_step(self, steps: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while len(read_metrics(self.run_dir)) < steps:
            assert self.process.poll() is None, self.stderr()
            assert time.monotonic() < deadline, f"no step {steps} within {timeout_s}s"
            time.sleep(0.1)

    def kill(self) -> None:
        """Whatever is left, after a failed assertion."""
        if self.process.poll() is None:
            launcher = psutil.Process(self.process.pid)
            for process in [launcher, *launcher.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            self.process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("frozen", ["learner", "buffer"])
def test_a_frozen_learner_or_buffer_stops_the_run_naming_it(tmp_path, frozen):
    run = Launch(tmp_path, "run.total_steps=1000", "run.stall_timeout_s=10",
                 "learner.checkpoint_every=2")  # fmt: skip
    victim = None
    try:
        run.wait_for_step(3)
        victim = run.role(frozen)
        victim.send_signal(signal.SIGSTOP)  # as a deadlock would look from outside
        frozen_at = time.monotonic()
        status = run.process.wait(timeout=120)
        stopped_s = time.monotonic() - frozen_at
    finally:
        with contextlib.suppress(psutil.Error, AttributeError):
            victim.send_signal(signal.SIGCONT)  # killed with the rest if still there
        run.kill()
    err = run.stderr()
    print(f"{frozen} frozen: the run stopped {stopped_s:.1f}s later")
    assert status == 1, err
    assert f"asyncrl: run failed: {frozen} (pid {victim.pid}) stalled: no progress for " in err
    assert "(run.stall_timeout_s=10); since " in err
    assert "what the other processes last reported:" in err
    other = "buffer: serving (" if frozen == "learner" else "learner: "
    assert f"\n    {other}" in err
    checkpoint = latest_checkpoint(run.run_dir)
    assert checkpoint is not None
    assert f"continue the run from {checkpoint.name} with: asyncrl launch --resume" in err
    assert processes_of(run.run_dir) == []


REWARD_ONLY_IN_GENERATORS = """
from pathlib import Path


def under_a_generator() -> bool:
    # the function is imported in a child of the role (a contained check, a reward
    # worker), so walk up from this process: python -m asyncrl.run.roles generator RUN_DIR
    # (/proc/self, not getpid(): the child may be in a PID namespace of its own)
    process = "self"
    while process not in ("0", "1"):
        argv = Path(f"/proc/{process}/cmdline").read_bytes().split(b"\\0")
        if argv[1:4] == [b"-m", b"asyncrl.run.roles", b"generator"]:
            return True
        process = Path(f"/proc/{process}/stat").read_text().rsplit(")", 1)[1].split()[1]
    return False


if under_a_generator():
    raise RuntimeError("this reward function cannot load in a generator")


def reward(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
"""


@pytest.mark.slow
def test_a_generator_that_can_never_start_stops_the_run_with_its_error(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_ONLY_IN_GENERATORS)
    run = Launch(tmp_path, "run.total_steps=5", f"reward.function={reward}:reward")
    try:
        status = run.process.wait(timeout=120)
    finally:
        run.kill()
    err = run.stderr()
    assert status == 1, err
    assert err.count("asyncrl: generator-0 exited with status 1") == START_FAILURES - 1
    (failed,) = [line for line in err.splitlines() if line.startswith("asyncrl: run failed:")]
    assert failed.startswith(
        "asyncrl: run failed: generator-0 failed 3 times in a row before making any progress, "
        "each time with: "
    )
    assert "RuntimeError: this reward function cannot load in a generator" in failed
    assert processes_of(run.run_dir) == []
    assert os.listdir(run.run_dir / "progress")  # the roles reported
