"""metrics.jsonl and aim receive the same values, under flat and namespaced names."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from asyncrl.core.tracking import NullAim, Tracker, aim_name


def test_aim_names_are_namespaced_by_their_first_word_only_for_known_namespaces():
    assert aim_name("buffer_dropped_stale") == "buffer/dropped_stale"
    assert aim_name("reward_mean") == "reward/mean"
    assert aim_name("eval_reward_mean") == "eval/reward_mean"
    assert aim_name("generators_busy_fraction") == "generators/busy_fraction"
    assert aim_name("samples_total") == "samples_total"
    assert aim_name("version") == "version"


def test_tracker_writes_one_json_line_per_step(tmp_path):
    tracker = Tracker(tmp_path, "test", {"lr": 1e-3}, use_aim=False)
    assert isinstance(tracker.aim, NullAim)
    tracker.log(0, {"reward_mean": 0.25, "version": 1})
    tracker.log(1, {"reward_mean": 0.5, "version": 2})
    tracker.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [
        {"step": 0, "reward_mean": 0.25, "version": 1},
        {"step": 1, "reward_mean": 0.5, "version": 2},
    ]


def test_a_value_with_nothing_to_measure_is_null_in_strict_json_and_not_sent_to_aim(tmp_path):
    tracked = []

    class RecordingAim(NullAim):
        def track(self, value, name, step):
            tracked.append((name, step, value))

    tracker = Tracker(tmp_path, "test", {}, use_aim=False)
    tracker.aim = RecordingAim()
    tracker.log(3, {"logprob_mismatch": float("nan"), "reward_mean": 0.5, "version": 4})
    tracker.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    line = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON line"))
    assert line == {"step": 3, "logprob_mismatch": None, "reward_mean": 0.5, "version": 4}
    assert tracked == [("reward/mean", 3, 0.5), ("version", 3, 4)]


def test_aim_run_in_the_run_directory_holds_every_logged_value(tmp_path):
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager

    tracker = Tracker(tmp_path, "test", {"algorithm": {"group_size": 8}}, use_aim=True)
    for step, reward in enumerate([0.1, 0.2, 0.7]):
        tracker.log(step, {"reward_mean": reward, "buffer_held": float(step)})
    tracker.close()

    repo = Repo.from_path(str(tmp_path))
    (run_hash,) = list(repo.list_all_runs())
    RepoIndexManager.get_index_manager(repo).index(run_hash)  # the SDK reads indexed runs only
    run = repo.get_run(run_hash)
    metrics = {metric.name: metric for metric in run.metrics()}
    assert {"reward/mean", "buffer/held"} <= set(metrics)
    _, values = metrics["reward/mean"].values.sparse_numpy()
    assert sorted(values.round(6).tolist()) == [0.1, 0.2, 0.7]
    assert run["hparams"]["algorithm"]["group_size"] == 8


def test_sampled_generations_reach_aim_as_text_per_step(tmp_path):
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager
    from aim.storage.context import Context

    tracker = Tracker(tmp_path, "test", {}, use_aim=True)
    tracker.log_generations(3, [{"prompt": "123=", "response": "234", "reward": 1.0}])
    tracker.log_generations(4, [{"prompt": "555=", "response": "6", "reward": 0.3}])
    tracker.close()

    repo = Repo.from_path(str(tmp_path))
    (run_hash,) = list(repo.list_all_runs())
    RepoIndexManager.get_index_manager(repo).index(run_hash)
    sequence = repo.get_run(run_hash).get_text_sequence("generations", Context({"sample": 0}))
    steps, (texts, *_) = sequence.data.items_list()
    assert steps == [3, 4]
    assert texts[0].data == "prompt: 123=\nresponse: 234\nreward: 1.0"
    assert "response: 6" in texts[1].data


def test_generations_are_not_decoded_or_written_when_aim_is_off(tmp_path):
    tracker = Tracker(tmp_path, "test", {}, use_aim=False)
    tracker.log_generations(0, [{"prompt": "1=", "response": "2"}])
    tracker.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


# ------------------------------------------------------------------ faults
# aim is a viewer: its failures turn it off and training goes on. metrics.jsonl is the
# run's record: a line that cannot be written stops the learner with one clear line.


class FakeAimRun:
    """Stands in for aim's Run; ``track`` raises once ``fail_after`` values went in."""

    def __init__(
        self, fail_after: int | None = None, close_blocks: bool = False, close_raises=False
    ):
        self.tracked: list[tuple] = []
        self.fail_after = fail_after
        self.release = threading.Event()
        self.close_blocks = close_blocks
        self.close_raises = close_raises
        self.closed = threading.Event()

    def track(self, value, name, step, context=None):
        if self.fail_after is not None and len(self.tracked) >= self.fail_after:
            raise OSError(28, "No space left on device")
        self.tracked.append((name, step, value))

    def close(self):
        if self.close_blocks:
            self.release.wait()
        self.closed.set()
        if self.close_raises:
            raise OSError(28, "No space left on device")


def fake_aim(monkeypatch, run: FakeAimRun | Exception) -> None:
    def open_aim(*_):
        if isinstance(run, Exception):
            raise run
        return run

    monkeypatch.setattr("asyncrl.core.tracking.open_aim", open_aim)


def read_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_aim_failing_to_track_is_turned_off_with_one_warning_and_every_step_is_logged(
    tmp_path, monkeypatch, caplog
):
    run = FakeAimRun(fail_after=3, close_raises=True)
    fake_aim(monkeypatch, run)
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    tracker = Tracker(tmp_path, "test", {}, use_aim=True)
    for step in range(4):
        tracker.log(step, {"reward_mean": 0.5})
        tracker.log_generations(step, [{"prompt": "1=", "response": "2"}])
    tracker.close()
    for thread in threading.enumerate():
        if thread.name == "aim-close":
            thread.join()  # the failed run's close, in the background: it raised

    assert run.closed.is_set()
    assert uncaught == []  # no traceback of the close in the log, only the one warning

    assert len(read_lines(tmp_path)) == 4  # training went on
    assert [(line["tracking_aim_enabled"], line["tracking_aim_failures_total"])
            for line in read_lines(tmp_path)] == [(1, 0), (0, 1), (0, 1), (0, 1)]  # fmt: skip
    assert len(run.tracked) == 3  # nothing sent to aim once it failed
    [warning] = [r for r in caplog.records if r.name == "asyncrl.tracking"]
    assert warning.levelname == "WARNING"
    assert "No space left on device" in warning.getMessage()
    assert "aim is off for the rest of this run" in warning.getMessage()


def test_aim_that_cannot_open_leaves_the_run_without_aim_and_counted(tmp_path, monkeypatch, caplog):
    fake_aim(monkeypatch, RuntimeError("the repo is locked"))
    tracker = Tracker(tmp_path, "test", {}, use_aim=True)
    tracker.log(0, {"reward_mean": 0.5})
    tracker.close()
    [line] = read_lines(tmp_path)
    assert line["tracking_aim_enabled"] == 0 and line["tracking_aim_failures_total"] == 1
    assert "aim failed to open its repository (RuntimeError: the repo is locked)" in caplog.text


def test_aim_failing_on_a_generation_text_is_turned_off(tmp_path, monkeypatch):
    run = FakeAimRun(fail_after=0)
    fake_aim(monkeypatch, run)
    tracker = Tracker(tmp_path, "test", {}, use_aim=True)
    tracker.log_generations(0, [{"prompt": "1=", "response": "2"}] * 3)
    assert not tracker.aim.enabled
    assert tracker.aim.failures == 1  # one failure, not one per generation
    tracker.close()


def test_closing_aim_that_hangs_is_abandoned_with_a_warning(tmp_path, monkeypatch, caplog):
    run = FakeAimRun(close_blocks=True)
    fake_aim(monkeypatch, run)
    tracker = Tracker(tmp_path, "test", {}, use_aim=True)
    tracker.aim.close_timeout_s = 0.05
    tracker.log(0, {"reward_mean": 0.5})
    try:
        tracker.close()  # returns although aim's close never does
        assert not run.closed.is_set()
        assert "closing did not finish within 0.05s and was abandoned" in caplog.text
        assert tracker.aim.failures == 1
    finally:
        run.release.set()


def test_a_metrics_line_that_cannot_be_written_stops_with_one_line_naming_the_file(tmp_path):
    from asyncrl.core.tracking import RecordWriteError

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    tracker = Tracker(tmp_path, "test", {}, use_aim=False)
    with pytest.raises(RecordWriteError) as raised:
        tracker.log(0, {"reward_mean": 0.5})
    message = str(raised.value)
    assert message == (
        f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device (errno 28); "
        "the learner stops"
    )
    tracker.close()  # the unwritten line is dropped, no second error hides the first


def test_a_trained_groups_line_that_cannot_be_written_stops_likewise(tmp_path):
    from asyncrl.core.tracking import JsonLines, RecordWriteError

    path = tmp_path / "trained_groups.jsonl"
    path.symlink_to("/dev/full")
    lines = JsonLines(path)
    with pytest.raises(RecordWriteError) as raised:
        lines.write({"step": 0, "version": 1, "group_ids": [0, 1]})
    assert f"cannot write {path}: No space left on device" in str(raised.value)
    lines.close()


EXIT_PROGRAM = """
import sys
from pathlib import Path
from aim.ext.cleanup import AutoClean
from asyncrl.core.tracking import Tracker

class Container:  # stands in for an aim container that a full disk keeps from closing
    pass

class Cleanup(AutoClean):
    def _close(self):
        raise OSError(28, "No space left on device")

tracker = Tracker(Path(sys.argv[1]), "test", {}, use_aim=True)
tracker.log(0, {"reward_mean": 0.5})
container = Container()
Cleanup(container)
tracker.close()
print("closed", flush=True)
sys.exit(3)
"""


def test_the_process_exits_after_aim_closed_even_if_aims_exit_cleanup_would_fail(tmp_path):
    # aim's exit handler waits without bound for its cleanups; one that raises (a full
    # disk) never lets it end: the learner hung there for ever after its error
    result = subprocess.run(
        [sys.executable, "-c", EXIT_PROGRAM, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout == "closed\n"
    assert result.returncode == 3, result.stderr
