"""The launcher's stop gives the learner ``learner.stop_timeout_s`` for its final checkpoint."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.run import closing, launch, local_run, supervision
from asyncrl.run.local_run import Supervisor
from asyncrl.run.supervision import stop_phases, stop_timeout_s

REPO = Path(__file__).resolve().parents[3]

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
    monkeypatch.setattr(supervision, "GENERATORS_STOP_S", 0.0)  # no generators to wait for
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


# -------------------------------------------- a run directory that cannot be written


@pytest.mark.parametrize(
    ("where", "said"),
    [
        (lambda tmp: ["--run-dir", "/proc/asyncrl-no-such-dir"], "/proc/asyncrl-no-such-dir"),
        (lambda tmp: ["--run-dir", "/proc/self"], "/proc/self"),  # there, and read-only
        (lambda tmp: ["--run-dir", str(tmp / "a-file" / "run")], "a-file/run: Not a directory"),
        (lambda tmp: [f"run.output_dir={tmp / 'a-file' / 'runs'}"], "a-file/runs/quickstart-"),
    ],
    ids=["cannot-create", "read-only", "under-a-file", "output-dir"],
)
def test_an_unwritable_run_directory_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, where, said: str
) -> None:
    (tmp_path / "a-file").write_text("")
    arguments = where(tmp_path)
    overrides = [a for a in arguments if "=" in a]
    run_dir = Path(arguments[1]) if arguments[0] == "--run-dir" else None
    assert launch.launch(config(*overrides), run_dir, quiet=True) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("asyncrl: cannot write the run directory ")
    assert said in line and line.endswith("(choose another with --run-dir or run.output_dir)")


class RecordingConsole:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, message: str, error: bool = False) -> None:
        self.notes.append(message)

    def update(self, health: list) -> None:
        pass


def test_a_fault_of_the_launcher_while_supervising_stops_the_run_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No process is started: the supervision's first tick raises (a bug, a full disk)."""

    def broken(supervisor, console):
        raise RuntimeError("a tick went wrong")

    console, stopped = RecordingConsole(), []
    monkeypatch.setattr(local_run, "open_console", lambda *args: contextlib.nullcontext(console))
    monkeypatch.setattr(local_run, "_prctl", lambda option, value: None)  # not on pytest
    monkeypatch.setattr(local_run, "_kill_orphans", lambda: None)  # pytest's children are not ours
    monkeypatch.setattr(Supervisor, "start_all", lambda self, resume_from=None: None)
    monkeypatch.setattr(Supervisor, "stop_all", lambda self, hurry: stopped.append(True))
    monkeypatch.setattr(local_run, "supervise", broken)
    assert launch.launch(config(), tmp_path / "run", quiet=True) == 1
    assert stopped == [True]
    trace, closing = console.notes[-2:]
    assert 'raise RuntimeError("a tick went wrong")' in trace  # the traceback, for a bug report
    assert closing.startswith(
        "asyncrl: run failed: the launcher failed while supervising: "
        "RuntimeError('a tick went wrong')"
    )


@pytest.mark.parametrize(
    ("record", "shown"),
    [
        ({"eval_reward_mean": 0.5, "eval_samples": 128}, "; final eval reward 0.500 over 128"),
        ({"eval_reward_mean": "0.5", "eval_samples": None}, "; final eval reward — over —"),
        ({"eval_reward_mean": float("nan"), "eval_samples": 4}, "; final eval reward nan over 4"),
        ([1, 2], ""),
    ],
)
def test_the_closing_line_shows_any_final_eval_record_without_raising(tmp_path, record, shown):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "eval.json").write_text(json.dumps(record))
    assert closing.final_eval_text(tmp_path).startswith(shown)


@pytest.mark.parametrize(("free_mib", "said"), [(0.5, True), (15.9, True), (16, False)])
def test_a_failed_run_on_a_full_disk_says_so(tmp_path, monkeypatch, free_mib, said):
    usage = closing.shutil.disk_usage(tmp_path)._replace(free=int(free_mib * 2**20))
    monkeypatch.setattr(closing.shutil, "disk_usage", lambda path: usage)
    message = closing.closing_message(tmp_path, 1, "learner exited with status 1", 3.0)
    assert ("No space left on device" in message) is said
    assert message.startswith("asyncrl: run failed: learner exited with status 1")


def test_the_stop_removes_the_weights_segment_a_killed_learner_left(tmp_path: Path) -> None:
    from asyncrl.weights.shm.segment import POINTER_FILE, SHM_DIR
    from asyncrl.weights.shm.writer import ShmWriter

    writer = ShmWriter(tmp_path)  # the learner's writer, as rank 0 makes it
    assert writer.create([]) or pytest.skip("no writable /dev/shm here")
    writer._map.close()  # the learner is killed: nothing of its close() runs
    segment = SHM_DIR / writer.name
    try:
        assert segment.exists() and (tmp_path / POINTER_FILE).exists()
        Supervisor(config(), tmp_path).stop_all()  # nothing running: only the clean-up
        assert not segment.exists()
        assert not (tmp_path / POINTER_FILE).exists()
    finally:
        segment.unlink(missing_ok=True)  # this test's own, even when it fails


def _checkpoints(run_dir, complete: dict[int, bool], updates: list[float]) -> None:
    for step, done in complete.items():
        folder = run_dir / "checkpoints" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        if done:
            (folder / "COMPLETE").write_text("")
    lines = [
        json.dumps({"step": i, "version": i + 1, "time_update_s": u}) for i, u in enumerate(updates)
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_a_stop_checkpoint_cut_short_is_named_with_the_setting_to_raise(tmp_path):
    """A stop during a step longer than learner.stop_timeout_s kills the learner mid-save:
    the closing lines say which checkpoint was lost, why, and where the run resumes."""
    _checkpoints(tmp_path, {4: True, 6: False}, [12.0, 31.0, 29.5])
    message = closing.closing_message(tmp_path, 143, None, 1.0)
    assert "the checkpoint step-000006 was cut short" in message
    assert "took up to 31 s" in message and "raise learner.stop_timeout_s" in message
    assert message.endswith(
        f"continue the run from step-000004 with: asyncrl launch --resume {tmp_path}"
    )


def test_no_cut_short_line_when_the_newest_checkpoint_is_complete_or_the_run_failed(tmp_path):
    _checkpoints(tmp_path / "stopped", {4: False, 6: True}, [30.0])
    assert "cut short" not in closing.closing_message(tmp_path / "stopped", 143, None, 1.0)
    _checkpoints(tmp_path / "failed", {4: True, 6: False}, [30.0])
    failed = closing.closing_message(tmp_path / "failed", 1, "the learner exited with 1", 1.0)
    assert "cut short" not in failed
