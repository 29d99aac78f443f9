"""Issue 27, F1: a reward or environment module is imported for checking in a contained
child, never in the command's own process. One that hangs, crashes, allocates past
`reward.memory_limit_mb`, stops its parent or leaves a daemon behind at import is one
problem naming it, and no process of it survives `asyncrl validate`."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.generation import contained
from asyncrl.run.preflight import PreflightError, preflight

ROOT = Path(__file__).resolve().parents[3]
WITHOUT_NAMESPACE = (
    "import asyncrl.generation.contained as c; c.enter_pid_namespace = lambda: False; "
    "c.keeper_main()"
)

HANGS = "import time\ntime.sleep(3600)\n"
STOPS_ITS_PARENT = (
    "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(3600)\n"
)
CRASHES = "import ctypes\nctypes.string_at(0)\n"
ALLOCATES = "block = bytearray(2 << 30)\n"
DAEMONISES = """\
import os, time
if os.fork() == 0:  # the classic daemon: fork, setsid, fork again, parent exits
    os.setsid()
    if os.fork() == 0:
        with open({pid_file!r}, "w") as file:
            file.write(os.readlink("/proc/self"))  # its pid as the host sees it
        time.sleep(3600)
    os._exit(0)
time.sleep(0.5)
"""
SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
"""


@pytest.fixture(params=["pid namespace", "subreaper only"])
def isolation(request, monkeypatch) -> str:
    """Both ways the child is kept: in a PID namespace, and where the kernel refuses one."""
    if request.param == "subreaper only":
        monkeypatch.setattr(contained, "KEEPER_COMMAND", WITHOUT_NAMESPACE)
    return request.param


def reward_module(tmp_path: Path, body: str) -> str:
    path = tmp_path / "user_reward.py"
    path.write_text(body + SCORE)
    return f"{path}:compute_score"


def only_problem(spec: str, *overrides: str) -> str:
    config = load_config(None, ["model.tiny={}", f"reward.function={spec}", *overrides])
    with pytest.raises(PreflightError) as error:
        preflight(config, machine=False)
    assert len(error.value.problems) == 1, error.value.problems
    return error.value.problems[0]


def wait_until_gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``within_s``: a killed process takes a
    moment to be reaped."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_a_module_that_hangs_at_import_is_one_problem_naming_it(tmp_path, isolation):
    spec = reward_module(tmp_path, HANGS)

    problem = only_problem(spec, "reward.load_timeout_s=1")

    assert problem == (
        f"reward.function: {spec}: importing it did not finish within reward.load_timeout_s=1 s; "
        "it was stopped, with every process it started"
    )


@pytest.mark.timeout(120)
def test_an_allocation_at_import_runs_under_the_memory_limit_not_in_this_process(tmp_path):
    spec = reward_module(tmp_path, ALLOCATES)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB

    problem = only_problem(spec, "reward.memory_limit_mb=512")

    assert problem.startswith(f"reward.function: {spec}: ran out of memory: ")
    assert "reward.memory_limit_mb=512" in problem
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mib < 512, f"the import ran in this process: its peak grew {grown_mib:.0f} MiB"


@pytest.mark.timeout(60)
def test_a_daemon_started_at_import_does_not_outlive_the_check(tmp_path, isolation):
    pid_file = tmp_path / "daemon.pid"
    spec = reward_module(tmp_path, DAEMONISES.format(pid_file=str(pid_file)))
    config = load_config(None, ["model.tiny={}", f"reward.function={spec}"])

    try:
        preflight(config, machine=False)  # the module is fine otherwise: no problem
        daemon = int(pid_file.read_text())
        assert wait_until_gone(daemon), f"the daemon {daemon} outlived the check"
    finally:
        _kill_pid_in(pid_file)


@pytest.mark.timeout(60)
def test_an_import_slower_than_a_reward_call_may_take_is_given_load_timeout_s(tmp_path):
    """A module importing torch takes seconds (more on a busy machine): its import is held
    to reward.load_timeout_s, not to the 1 s a call to score may take."""
    spec = reward_module(tmp_path, "import time\ntime.sleep(2)\n")
    overrides = [f"reward.function={spec}", "reward.timeout_s=1", "reward.load_timeout_s=30"]
    preflight(load_config(None, ["model.tiny={}", *overrides]), machine=False)


@pytest.mark.timeout(60)
def test_an_environment_module_that_hangs_at_import_is_named(tmp_path, isolation):
    module = tmp_path / "slow_env.py"
    module.write_text(
        HANGS + "class Env:\n    def reset(self, row): ...\n    def step(self, r): ...\n"
    )
    config = load_config(
        None, ["model.tiny={}", f"environment.name={module}:Env", "reward.load_timeout_s=1"]
    )
    with pytest.raises(PreflightError) as error:
        preflight(config, machine=False)

    assert error.value.problems == [
        f"environment: {module}:Env: building it did not finish within "
        "reward.load_timeout_s=1 s; "
        "it was stopped, with every process it started"
    ]


# --------------------------------------------------------------------------
# `asyncrl validate` itself, in a process of its own (these attacks would stop or crash
# the test's process if the module ran in it)


def validate(tmp_path: Path, spec: str, *overrides: str) -> subprocess.CompletedProcess:
    """``asyncrl validate`` started by a wrapper process of its own session: a module that
    stops "its parent" in the validating process stops the wrapper, not this test; the
    whole session is killed afterwards whatever happened."""
    config = tmp_path / "config.yaml"
    config.write_text(f"model:\n  tiny: {{}}\nreward:\n  function: {spec}\n")
    command = [sys.executable, "-m", "asyncrl", "validate", str(config), *overrides]
    wrapper = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
    process = subprocess.Popen(
        [sys.executable, "-c", wrapper, *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=ROOT,
    )
    try:
        out, err = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, says",
    [
        (HANGS, "importing it did not finish within reward.load_timeout_s=2 s"),
        (STOPS_ITS_PARENT, "importing it did not finish within reward.load_timeout_s=2 s"),
        (CRASHES, "importing it failed: its process was killed by SIGSEGV"),
        (ALLOCATES, "ran out of memory: an allocation went past reward.memory_limit_mb=256"),
    ],
    ids=["hangs", "stops its parent", "crashes", "allocates 2 GiB"],
)
def test_validate_names_a_module_that_hangs_crashes_or_stops_at_import(tmp_path, body, says):
    spec = reward_module(tmp_path, body)

    result = validate(tmp_path, spec, "reward.load_timeout_s=2", "reward.memory_limit_mb=256")

    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "asyncrl: the run cannot start (1 problem(s)):"
    assert len(lines) == 2 and lines[1].startswith(f"  reward.function: {spec}: {says}")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_validate_leaves_no_daemon_of_the_module_behind(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    spec = reward_module(tmp_path, DAEMONISES.format(pid_file=str(pid_file)))
    try:
        result = validate(tmp_path, spec)
        assert result.returncode == 0, result.stderr
        daemon = int(pid_file.read_text())
        assert wait_until_gone(daemon), f"the daemon {daemon} outlived asyncrl validate"
    finally:
        _kill_pid_in(pid_file)


def _kill_pid_in(pid_file: Path) -> None:
    """Clean up after a failing run: the daemon whose pid the file holds."""
    with contextlib.suppress(OSError, ValueError, psutil.Error):
        psutil.Process(int(pid_file.read_text())).kill()
