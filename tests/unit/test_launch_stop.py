"""The launcher's stop gives the learner ``learner.stop_timeout_s`` for its final checkpoint."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl import launch
from asyncrl.config import load_config
from asyncrl.launch import Supervisor, stop_phases, stop_timeout_s

REPO = Path(__file__).resolve().parents[2]

SLOW_TO_SAVE = """
import signal, sys, time
def on_term(*_):
    time.sleep({save_s})  # the final checkpoint
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
time.sleep(120)
"""


def slow_learner(save_s: float) -> subprocess.Popen:
    code = SLOW_TO_SAVE.format(save_s=save_s)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"  # its handler is installed
    return process


def config(*overrides: str):
    return load_config(REPO / "configs/quickstart.yaml", list(overrides))


def test_learner_deadline_follows_its_stop_timeout() -> None:
    default, patient = config(), config("learner.stop_timeout_s=60")
    assert dict(stop_phases(default))["learner"] < dict(stop_phases(patient))["learner"]
    assert stop_timeout_s(patient) - stop_timeout_s(default) == pytest.approx(52.0)
    phases = [by_s for _, by_s in stop_phases(patient, slack_s=1.5)]
    assert phases == sorted(phases)  # generators, then learner, then buffer


@pytest.mark.parametrize(("stop_timeout", "exit_status"), [(0.3, -signal.SIGKILL), (6.0, 0)])
def test_a_slow_final_checkpoint_is_waited_for_only_as_long_as_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stop_timeout: float, exit_status: int
) -> None:
    monkeypatch.setattr(launch, "GENERATORS_STOP_S", 0.0)  # no generators to wait for
    supervisor = Supervisor(config(f"learner.stop_timeout_s={stop_timeout}"), tmp_path)
    learner = slow_learner(save_s=1.0)
    supervisor.processes["learner"] = learner
    try:
        supervisor.stop_all()
        assert learner.returncode == exit_status
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
