"""The launcher's side of two hardenings, on stand-in processes.

- Learner ranks it starts itself are supervised as one learner: any rank
  failing fails it, and stopping ends every rank.
- Each role gets the launcher's config from memory (``ASYNCRL_CONFIG``); a role
  reads ``RUN_DIR/config.yaml`` only when started by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config, save_config
from asyncrl.run import supervision
from asyncrl.run.local_run import RankGroup, Supervisor
from asyncrl.run.roles import CONFIG_ENV, config_env, read_config
from tests.helpers.waiting import wait_until

REPO = Path(__file__).resolve().parents[3]

RANK = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("ready", flush=True)
time.sleep({sleep_s})
sys.exit({status})
"""


def rank(status: int = 0, sleep_s: float = 120) -> subprocess.Popen:
    code = RANK.format(sleep_s=sleep_s, status=status)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def quickstart(*overrides: str):
    return load_config(REPO / "configs/quickstart.yaml", list(overrides))


def supervisor_with(tmp_path: Path, group: RankGroup) -> Supervisor:
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "learner.log").write_text("rank 1: boom\n")
    supervisor = Supervisor(quickstart("learner.world_size=2"), tmp_path)
    supervisor.processes["learner"] = group
    return supervisor


def test_any_rank_failing_fails_the_learner_and_the_stop_ends_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervision, "GENERATORS_STOP_S", 0.0)
    healthy, failing = rank(), rank(status=3, sleep_s=0.2)
    supervisor = supervisor_with(tmp_path, RankGroup([healthy, failing]))
    try:
        wait_until(lambda: supervisor.failure() is not None, 10.0)
        failure = supervisor.failure()
        assert failure.startswith("learner rank 1 of 2 exited with status 3; last lines of ")
        assert "rank 1: boom" in failure
        assert not supervisor.learner_finished()
        assert healthy.poll() is None  # still running until the stop
        supervisor.stop_all()
        assert healthy.returncode == 0  # it got SIGTERM, as every rank does
    finally:
        for process in (healthy, failing):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_the_learner_is_done_once_every_rank_exited_cleanly(tmp_path: Path) -> None:
    first, last = rank(sleep_s=0.1), rank(sleep_s=1.5)
    group = RankGroup([first, last])
    supervisor = supervisor_with(tmp_path, group)
    wait_until(lambda: first.poll() is not None, 10.0)
    assert group.poll() is None and not supervisor.learner_finished()  # rank 1 still works
    assert supervisor.failure() is None
    wait_until(supervisor.learner_finished, 10.0)
    assert supervisor.failure() is None


def test_each_rank_is_started_with_its_rank_and_a_fresh_private_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = []

    def spawn(self, name, command, env=None):
        started.append((name, command, env))
        return rank(sleep_s=0)

    monkeypatch.setattr(Supervisor, "_spawn", spawn)
    (tmp_path / "logs").mkdir()
    supervisor = Supervisor(quickstart("learner.world_size=2"), tmp_path)
    supervisor.start("learner", "learner", ranks=2)
    store = Path(started[0][2]["ASYNCRL_LEARNER_STORE"])
    assert [(env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) for _, _, env in started] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert all(command[3:5] == ["learner", str(tmp_path)] for _, command, _ in started)
    assert store.parent.stat().st_mode & 0o777 == 0o700 and not store.exists()
    store.write_text("an earlier group's")
    supervisor.start("learner", "learner", ranks=2)
    assert not store.exists()  # removed before the next start
    wait_until(lambda: supervisor.processes["learner"].poll() == 0, 10.0)
    supervisor.stop_all()
    assert not store.parent.exists()


def test_a_role_runs_the_launcher_s_config_and_reads_the_file_only_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched = quickstart("cluster.buffer_port=5555")
    evil = tmp_path / "evil.py"
    evil.write_text("def f(*args, **kwargs):\n    return 1.0\n")
    planted = quickstart("cluster.buffer_port=5555", f"reward.function={evil}:f")
    save_config(planted, tmp_path / "config.yaml")  # someone rewrote the run's file

    supervisor = Supervisor(launched, tmp_path)
    assert json.loads(supervisor.handed[CONFIG_ENV]) == launched.model_dump(mode="json")
    monkeypatch.setenv(CONFIG_ENV, supervisor.handed[CONFIG_ENV])
    assert read_config(tmp_path) == launched
    assert CONFIG_ENV not in os.environ  # the role's children do not get it

    assert read_config(tmp_path) == planted  # `python -m asyncrl.run.roles` started by hand


def test_the_config_handed_over_is_validated_like_any_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = json.loads(config_env(quickstart())[CONFIG_ENV])
    raw["buffer"]["max_staleness"] = -1
    monkeypatch.setenv(CONFIG_ENV, json.dumps(raw))
    with pytest.raises(Exception, match="max_staleness"):
        read_config(tmp_path)
