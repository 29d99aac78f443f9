"""Issue 27, F1, in the scorer: `RewardScorer` checks its function in a contained child
(a module that hangs at import fails construction, it does not hang it), a worker that
never loads is replaced in bounded time, and what a function starts dies with its
worker."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.generation.rewards import RewardFunctionError, RewardScorer
from asyncrl.generation.rewards import scorer as scorer_module

DAEMON_WHEN_CALLED = """\
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.fork() == 0:  # fork, setsid, fork again: a daemon of the function's own
        os.setsid()
        if os.fork() == 0:
            with open({pid_file!r}, "w") as file:
                file.write(str(os.getpid()))
            time.sleep(3600)
        os._exit(0)
    time.sleep(0.5)
    return 1.0
"""


def module(tmp_path: Path, text: str) -> str:
    path = tmp_path / "scored_by.py"
    path.write_text(text)
    return f"{path}:compute_score"


@pytest.mark.timeout(60)
def test_a_module_that_hangs_at_import_fails_construction_instead_of_hanging_it(tmp_path):
    spec = module(tmp_path, "import time\ntime.sleep(3600)\ndef compute_score(*a): return 1.0\n")

    with pytest.raises(RewardFunctionError) as error:
        RewardScorer(spec, timeout_s=30, load_timeout_s=1)

    assert str(error.value) == (
        f"{spec}: importing it did not finish within reward.load_timeout_s=1 s; "
        "it was stopped, with every process it started"
    )


@pytest.mark.timeout(60)
def test_a_worker_that_never_loads_fails_the_scorer_in_bounded_time(tmp_path, monkeypatch):
    """The check's import passes, the workers' hang: each is replaced when its start-up time
    is up, and after three the scorer gives up instead of waiting for ever."""
    marker = tmp_path / "imported_once"
    spec = module(
        tmp_path,
        f"import os, time\nif os.path.exists({str(marker)!r}):\n    time.sleep(3600)\n"
        f"open({str(marker)!r}, 'w').close()\n"
        "def compute_score(*a):\n    return 1.0\n",
    )
    monkeypatch.setattr(scorer_module, "STARTUP_S", 0.0, raising=False)

    with RewardScorer(spec, timeout_s=0.5) as scorer:
        score = scorer.submit("d", "1", "1").result(timeout=30)

    assert score.error == "error:scorer"
    assert "did not load" in score.detail and "3 times" in score.detail


@pytest.mark.timeout(60)
def test_a_daemon_the_function_starts_dies_with_its_worker(tmp_path):
    pid_file = tmp_path / "daemon.pid"
    spec = module(tmp_path, DAEMON_WHEN_CALLED.format(pid_file=str(pid_file)))
    try:
        with RewardScorer(spec, timeout_s=10) as scorer:
            assert scorer.score("d", "1", "1").reward == 1.0
            daemon = psutil.Process(int(pid_file.read_text()))
        assert _gone(daemon), f"the daemon {daemon.pid} outlived the scorer"
    finally:
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            psutil.Process(int(pid_file.read_text())).kill()


def _gone(process: psutil.Process) -> bool:
    """Whether ``process`` ends (or is a zombie) within a few seconds of being killed."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
