"""Progress reports and the launcher's watchdog, on fake reports, a fake clock and stand-in
processes: a role that stops making progress is reported (a generator killed to be
restarted, the learner or buffer stopping the run), a generator that fails the same way at
every start stops the run, and nothing a tick reads (a garbage report, a vanished log) can
raise out of supervision."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.core import progress
from asyncrl.core.progress import Progress, progress_path
from asyncrl.run.local_run import Supervisor
from asyncrl.run.supervision import Replica
from asyncrl.run.watchdog import (
    START_FAILURES,
    START_TIMEOUT_S,
    StartFailures,
    Watchdog,
    failure_line,
)

REPO = Path(__file__).resolve().parents[3]


class Clock:
    """A clock the test moves."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def quickstart(*overrides: str):
    return load_config(REPO / "configs/quickstart.yaml", list(overrides))


def write_report(run_dir: Path, name: str, pid: int, advances: int, **fields) -> None:
    """A report as a role of process ``pid`` would write it."""
    report = {
        "name": name, "role": name.split("-")[0], "pid": pid, "host": "here",
        "started": time.time(), "doing": "serving", "detail": "", "since": time.time(),
        "advances": advances, "advanced_at": time.time(), "beat_at": time.time(),
        "patience_s": 0.0, "waiting_for": "",
    } | fields  # fmt: skip
    path = progress_path(run_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))


# ------------------------------------------------------------------ the report


def test_a_report_is_written_at_once_when_what_the_role_does_changes_else_once_a_second(
    tmp_path: Path,
) -> None:
    clock = Clock()
    reporter = Progress(tmp_path, "learner", "learner", clock=clock)
    reporter.beat("starting", advanced=False)
    first = progress.read(tmp_path, "learner")
    assert first is not None and (first.doing, first.advances, first.pid) == (
        "starting",
        0,
        first.pid,
    )
    clock.now += 0.5
    reporter.beat("waiting for a batch for step 1")  # a change: written now
    assert progress.read(tmp_path, "learner").advances == 1
    clock.now += 0.3
    reporter.beat("waiting for a batch for step 1", detail=lambda: "not called")
    assert progress.read(tmp_path, "learner").advances == 1  # same doing, within a second
    clock.now += 1.0
    reporter.beat("waiting for a batch for step 1", detail=lambda: "3 ready")
    report = progress.read(tmp_path, "learner")
    assert (report.advances, report.what()) == (3, "waiting for a batch for step 1 (3 ready)")
    assert report.since == pytest.approx(1000.5)  # since it began waiting, not since the beat
    assert report.advanced_at == pytest.approx(1001.8)
    assert [p.name for p in (tmp_path / "progress").iterdir()] == ["learner.json"]  # no temp


def test_a_report_that_cannot_be_written_never_raises_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "progress").write_text("a file where the directory should be")
    clock = Clock()
    reporter = Progress(tmp_path, "buffer", "buffer", clock=clock)
    with caplog.at_level(logging.WARNING, logger="asyncrl.progress"):
        for step in range(3):
            clock.now += 2
            reporter.beat(f"step {step}", detail=lambda: 1 / 0)  # a broken detail too
    assert reporter.write_errors == 3
    assert len([r for r in caplog.records if "cannot write the progress report" in r.message]) == 1


def test_beats_go_to_the_report_this_process_started_and_nowhere_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "_current", None)
    monkeypatch.chdir(tmp_path)
    progress.beat("generating")  # a role started by hand, a test: no file, no error
    assert list(tmp_path.iterdir()) == []
    progress.start(tmp_path / "run", "generator-1", "generator")
    assert progress.read(tmp_path / "run", "generator-1").doing == "starting"
    progress.beat("generating")
    report = progress.read(tmp_path / "run", "generator-1")
    assert (report.doing, report.advances, report.role) == ("generating", 1, "generator")


@pytest.mark.parametrize(
    "content",
    ["", '{"name": "buffer", "pid": ', "[1, 2]", '{"name": "buffer"}', "\x00\xff garbage"],
    ids=["empty", "half-written", "not-an-object", "missing-keys", "binary"],
)
def test_a_report_that_is_not_one_reads_as_none(tmp_path: Path, content: str) -> None:
    path = progress_path(tmp_path, "buffer")
    path.parent.mkdir()
    path.write_bytes(content.encode("latin-1"))
    assert progress.read(tmp_path, "buffer") is None


def test_a_report_with_a_wrong_type_or_a_non_finite_time_reads_as_none(tmp_path: Path) -> None:
    write_report(tmp_path, "buffer", 7, advances="many")
    assert progress.read(tmp_path, "buffer") is None
    write_report(tmp_path, "buffer", 7, advances=True)
    assert progress.read(tmp_path, "buffer") is None
    (progress_path(tmp_path, "buffer")).write_text(
        progress_path(tmp_path, "buffer")
        .read_text()
        .replace('"patience_s": 0.0', '"patience_s": NaN')
    )
    assert progress.read(tmp_path, "buffer") is None
    write_report(tmp_path, "buffer", 7, advances=2, extra="a newer writer's key")
    assert progress.read(tmp_path, "buffer").advances == 2


# ------------------------------------------------------------------ the watchdog


def watchdog(run_dir: Path, timeout_s: float = 30.0) -> tuple[Watchdog, Clock, list[str]]:
    clock, notes = Clock(), []
    return Watchdog(run_dir, timeout_s, notes.append, clock=clock), clock, notes


def test_a_role_whose_count_stops_moving_is_reported_after_the_timeout(tmp_path: Path) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("learner", "learner", 11)
    for advances in range(1, 5):  # it advances every 20 s: never stalled
        write_report(tmp_path, "learner", 11, advances, doing=f"training step {advances}")
        assert dog.check() == []  # the count moved: seen now
        clock.now += 20
    clock.now += 9.9  # 29.9 s since the count last moved
    assert dog.check() == []
    clock.now += 0.1
    (stall,) = dog.check()
    assert (stall.name, stall.role, stall.starting) == ("learner", "learner", False)
    assert stall.idle_s == pytest.approx(30)
    text = stall.describe()
    assert text.startswith("learner (pid 11) stalled: no progress for 30s (run.stall_timeout_s=30)")
    assert "it has been training step 4" in text


def test_a_role_that_never_reports_is_stalled_from_its_start(tmp_path: Path) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("buffer", "buffer", 12)
    write_report(tmp_path, "buffer", 99, 50)  # another process's (an earlier launch's)
    clock.now += START_TIMEOUT_S - 1
    assert dog.check() == []
    clock.now += 1
    (stall,) = dog.check()
    assert stall.starting and stall.watched.report is None
    assert stall.describe() == (
        "buffer (pid 12) stalled: no progress report in 300s since it started "
        "(run.stall_timeout_s=30; 300s allowed to start)"
    )


def test_starting_counts_from_the_start_and_is_allowed_longer(tmp_path: Path) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("generator-0", "generator", 13)
    write_report(tmp_path, "generator-0", 13, 0, doing="starting")  # loading its model
    clock.now += START_TIMEOUT_S - 1
    assert dog.check() == []
    clock.now += 1
    (stall,) = dog.check()
    assert stall.starting
    assert stall.reason() == "stalled (no progress for 300s) while starting"
    slow, clock, _ = watchdog(tmp_path, timeout_s=1000)  # a longer timeout stands
    slow.watch("generator-0", "generator", 13)
    clock.now += 999
    assert slow.check() == []


def test_while_a_generator_starts_the_learner_waiting_for_a_batch_waits_for_it(
    tmp_path: Path,
) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("learner", "learner", 20)
    dog.watch("generator-0", "generator", 21)
    write_report(
        tmp_path, "learner", 20, 2, doing="waiting for a batch for step 1", waiting_for="generators"
    )
    write_report(tmp_path, "generator-0", 21, 0, doing="starting")
    for _ in range(5):
        assert dog.check() == []
        clock.now += 20  # 100 s: the learner waits on the generator's start
    write_report(tmp_path, "generator-0", 21, 1, doing="generating")  # its first advance
    assert dog.check() == []
    clock.now += 29
    write_report(tmp_path, "generator-0", 21, 2, doing="generating")
    assert dog.check() == []
    clock.now += 1  # the learner waited 30 s since the generator started: its own stall
    assert [s.name for s in dog.check()] == ["learner"]


def test_a_frozen_learner_is_blamed_not_the_generators_waiting_for_its_weights(
    tmp_path: Path,
) -> None:
    """The learner froze waiting for a batch; the generator's weight fetch hangs on it.
    Blaming the generator restarts it, and its start then excused the learner for ever
    (seen in CI: the run went on for 120 s instead of stopping at 10 s)."""
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("learner", "learner", 30)
    dog.watch("generator-0", "generator", 31)
    write_report(
        tmp_path, "learner", 30, 5, doing="waiting for a batch for step 3", waiting_for="generators"
    )
    write_report(tmp_path, "generator-0", 31, 9, doing="generating")
    assert dog.check() == []
    clock.now += 5  # the generator's fetch has waited a second: it says so
    write_report(tmp_path, "generator-0", 31, 9, doing="waiting for weights from the learner",
                 waiting_for="learner")  # fmt: skip
    assert dog.check() == []
    clock.now += 25
    assert [s.name for s in dog.check()] == ["learner"]


def test_a_generator_starting_but_waiting_for_the_learner_does_not_excuse_the_learner(
    tmp_path: Path,
) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("learner", "learner", 32)
    dog.watch("generator-0", "generator", 33)
    write_report(
        tmp_path, "learner", 32, 5, doing="waiting for a batch for step 3", waiting_for="generators"
    )
    write_report(tmp_path, "generator-0", 33, 0, doing="waiting for weights from the learner",
                 waiting_for="learner")  # fmt: skip
    assert dog.check() == []
    clock.now += 30
    assert [s.name for s in dog.check()] == ["learner"]


def test_patience_a_role_asks_for_lengthens_its_allowance(tmp_path: Path) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("learner", "learner", 14)
    write_report(tmp_path, "learner", 14, 9, doing="waiting for the final eval", patience_s=100.0)
    assert dog.check() == []
    clock.now += 99
    assert dog.check() == []
    clock.now += 1
    assert [s.name for s in dog.check()] == ["learner"]


def test_no_stall_when_off_or_for_a_process_that_has_exited(tmp_path: Path) -> None:
    off, clock, _ = watchdog(tmp_path, timeout_s=0)
    off.watch("buffer", "buffer", 15)
    clock.now += 10**6
    assert off.check() == []
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("generator-0", "generator", 16, alive=lambda: False)  # the restart path's
    clock.now += 10**6
    assert dog.check() == []


def test_a_generator_restart_excuses_only_a_role_waiting_on_generators(
    tmp_path: Path,
) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("learner", "learner", 17)
    dog.watch("learner-1", "learner", 27)
    write_report(tmp_path, "learner", 17, 3, doing="waiting for a batch for step 2",
                 waiting_for="generators")  # fmt: skip
    write_report(tmp_path, "learner-1", 27, 3, doing="training step 2")  # frozen in it
    assert dog.check() == []
    clock.now += 25
    dog.generators_restarting()  # a generator is down: the batch waits on its restart
    clock.now += 25
    assert [s.name for s in dog.check()] == ["learner-1"]  # its own stall all the same
    clock.now += 5
    assert [s.name for s in dog.check()] == ["learner", "learner-1"]


def test_a_role_on_another_node_without_a_report_is_said_once_and_not_watched(
    tmp_path: Path,
) -> None:
    dog, clock, notes = watchdog(tmp_path)
    dog.watch("generator-1", "generator", 18, local=False)
    clock.now += 31
    assert dog.check() == [] and dog.check() == []
    (note,) = notes
    assert "no progress report from generator-1 in 31s" in note and "not watched" in note
    write_report(tmp_path, "generator-1", 18, 1)  # the run directory is shared after all
    assert dog.check() == []
    clock.now += 30
    assert [s.name for s in dog.check()] == ["generator-1"]


def test_the_summary_says_what_every_other_role_last_reported(tmp_path: Path) -> None:
    dog, clock, _ = watchdog(tmp_path)
    for name, pid in (("learner", 1), ("buffer", 2), ("generator-0", 3), ("generator-1", 4)):
        dog.watch(name, name.split("-")[0], pid)
    write_report(tmp_path, "buffer", 2, 40, detail="0 ready samples, 1 generators")
    write_report(tmp_path, "generator-0", 3, 0, doing="starting")
    dog.check()
    clock.now += 12
    lines = dog.summary(leave_out="learner").splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("    buffer: serving (0 ready samples, 1 generators) since ")
    assert lines[0].endswith("; last advanced 12s ago")
    assert lines[1].startswith("    generator-0: starting since ")
    assert lines[2] == "    generator-1: no progress report"


def test_a_garbage_report_is_no_report_and_raises_nothing(tmp_path: Path) -> None:
    dog, clock, _ = watchdog(tmp_path)
    dog.watch("buffer", "buffer", 19)
    write_report(tmp_path, "buffer", 19, 5)
    assert dog.check() == []
    progress_path(tmp_path, "buffer").write_text('{"pid": 19, "advan')  # torn by a bad actor
    clock.now += 30
    (stall,) = dog.check()  # its last good report stands; its count did not move
    assert "it has been serving" in stall.describe()


# ------------------------------------------------------------------ start failures


def test_the_failure_line_is_the_logs_last_words_of_this_start(tmp_path: Path) -> None:
    log = tmp_path / "generator-0.log"
    log.write_text(
        "Traceback (most recent call last):\nRuntimeError: first process\n"
        "---- asyncrl launch: restart 1 ----\n"
        "2025-01-31 12:00:00,123 generator-0 INFO asyncrl.generator: loading\n\n"
    )
    assert failure_line(log) == "INFO asyncrl.generator: loading"  # no time: alike each start
    log.write_text("RuntimeError: first\n---- asyncrl launch: restart 1 ----\n")
    assert failure_line(log, "exit status 1") == "exit status 1"
    assert failure_line(tmp_path / "missing.log", "exit status -9") == "exit status -9"


def test_the_same_failure_before_any_progress_three_times_in_a_row_stops_the_run() -> None:
    failures = StartFailures()
    assert not failures.record(False, "RuntimeError: boom")
    assert not failures.record(False, "RuntimeError: other")  # another error: counts anew
    assert not failures.record(False, "RuntimeError: other")
    assert not failures.record(True, "RuntimeError: other")  # it made progress: anew
    for _ in range(START_FAILURES - 1):
        assert not failures.record(False, "RuntimeError: boom")
    assert failures.record(False, "RuntimeError: boom")
    assert failures.describe() == (
        "failed 3 times in a row before making any progress, each time with: RuntimeError: boom"
    )


def test_without_a_report_an_exit_after_a_minute_up_counts_as_progress() -> None:
    replica = Replica("generator-0", "default", 0)
    for _ in range(START_FAILURES + 2):
        assert not replica.exited(None, 61.0, "RuntimeError: boom")
    assert not replica.exited(None, 5.0, "RuntimeError: boom")
    assert not replica.exited(None, 5.0, "RuntimeError: boom")
    assert replica.exited(None, 5.0, "RuntimeError: boom")


# ------------------------------------------------------------------ the supervisor


CRASH = "import sys; print('RuntimeError: cannot load the reward', flush=True); sys.exit(1)"


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


class Spawned:
    """``Supervisor.start`` on stand-in processes: ``commands[role]`` is the Python run."""

    def __init__(self, supervisor: Supervisor, commands: dict[str, str]):
        self.supervisor, self.commands, self.started = supervisor, commands, []
        original = supervisor._spawn

        def spawn(name: str, command: list[str], env=None) -> subprocess.Popen:
            role = command[3]
            process = original(name, [sys.executable, "-c", self.commands[role]], env)
            self.started.append(process)
            return process

        supervisor._spawn = spawn

    def stop(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait()


def supervisor_at(tmp_path: Path, *overrides: str) -> Supervisor:
    (tmp_path / "logs").mkdir(exist_ok=True)
    notes: list[str] = []
    supervisor = Supervisor(quickstart("generators.replicas=1", *overrides), tmp_path, notes.append)
    supervisor.notes = notes
    return supervisor


def test_a_generator_that_crashes_the_same_way_at_every_start_stops_the_run(
    tmp_path: Path,
) -> None:
    supervisor = supervisor_at(tmp_path)
    spawned = Spawned(supervisor, {"generator": CRASH})
    try:
        replica = Replica("generator-0", "default", 0, backoff_s=0.01)
        supervisor.replicas[replica.name] = replica
        supervisor._start_generator(replica)
        deadline = time.monotonic() + 30
        while (failure := supervisor.restart_generators()) is None:
            assert time.monotonic() < deadline, supervisor.notes
            time.sleep(0.02)
    finally:
        spawned.stop()
    assert len(spawned.started) == START_FAILURES  # started, restarted twice, then no more
    assert failure.startswith(
        "generator-0 failed 3 times in a row before making any progress, "
        "each time with: RuntimeError: cannot load the reward; last lines of "
    )
    assert replica.restart_at is None  # no restart is left scheduled


def test_a_stalled_generator_is_killed_and_restarted_as_any_that_exits(tmp_path: Path) -> None:
    supervisor = supervisor_at(tmp_path, "run.stall_timeout_s=10")
    clock = Clock()
    supervisor.watchdog.clock = clock
    spawned = Spawned(supervisor, {"generator": "import time; time.sleep(120)"})
    try:
        replica = Replica("generator-0", "default", 0, backoff_s=0.01)
        supervisor.replicas[replica.name] = replica
        supervisor._start_generator(replica)
        victim = spawned.started[0]
        write_report(tmp_path, "generator-0", victim.pid, 7, doing="generating")
        assert supervisor.check_progress() is None and victim.poll() is None
        clock.now += 10
        assert supervisor.check_progress() is None  # a generator is replaced, not fatal
        assert victim.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while len(spawned.started) < 2:
            assert supervisor.restart_generators() is None
            assert time.monotonic() < deadline, supervisor.notes
            time.sleep(0.02)
    finally:
        spawned.stop()
    assert replica.restarts == 1 and replica.failures.count == 0  # it had made progress
    killed, exited, again = supervisor.notes
    assert killed.startswith(
        f"asyncrl: generator-0 (pid {victim.pid}) stalled: no progress for 10s"
    )
    assert killed.endswith(f"it has been generating; killing it (pid {victim.pid})")
    assert exited.startswith("asyncrl: generator-0 exited with status -9")
    assert again == "asyncrl: generator-0 started again (restart 1)"


def test_a_stalled_buffer_stops_the_run_saying_what_the_others_were_doing(tmp_path: Path) -> None:
    supervisor = supervisor_at(tmp_path, "run.stall_timeout_s=10")
    clock = Clock()
    supervisor.watchdog.clock = clock
    sleep = "import time; time.sleep(120)"
    spawned = Spawned(supervisor, {"buffer": sleep, "learner": sleep})
    try:
        supervisor.start("buffer", "buffer")
        supervisor.start("learner", "learner")
        buffer, learner = spawned.started
        write_report(tmp_path, "buffer", buffer.pid, 40, detail="0 ready samples, 0 generators")
        write_report(
            tmp_path,
            "learner",
            learner.pid,
            2,
            doing="waiting for a batch for step 2",
            waiting_for="generators",
        )
        assert supervisor.check_progress() is None
        clock.now += 10
        failure = supervisor.check_progress()
        assert buffer.poll() is None  # the run's stop ends it, in its order
    finally:
        spawned.stop()
    head, others, learner_line = failure.splitlines()
    assert head.startswith(f"buffer (pid {buffer.pid}) stalled: no progress for 10s")
    assert "it has been serving (0 ready samples, 0 generators)" in head
    assert others == "what the other processes last reported:"
    assert learner_line.startswith("    learner: waiting for a batch for step 2 since ")


def test_the_learner_is_not_blamed_for_waiting_while_a_generator_restarts(
    tmp_path: Path,
) -> None:
    supervisor = supervisor_at(tmp_path, "run.stall_timeout_s=10")
    clock = Clock()
    supervisor.watchdog.clock = clock
    sleep = "import time; time.sleep(120)"
    spawned = Spawned(supervisor, {"learner": sleep, "generator": sleep})
    try:
        supervisor.start("learner", "learner")
        (learner,) = spawned.started
        write_report(
            tmp_path,
            "learner",
            learner.pid,
            4,
            doing="waiting for a batch for step 3",
            waiting_for="generators",
        )
        replica = Replica("generator-0", "default", 0, restart_at=time.monotonic() + 60)
        supervisor.replicas[replica.name] = replica  # its process exited: a back-off
        supervisor.processes[replica.name] = exited = subprocess.Popen([sys.executable, "-c", ""])
        exited.wait()
        for _ in range(3):
            assert supervisor.check_progress() is None
            clock.now += 10
        replica.restart_at = time.monotonic()  # its back-off is over
        assert supervisor.restart_generators() is None
        generator = spawned.started[1]
        for _ in range(3):  # it loads its model
            assert supervisor.check_progress() is None
            clock.now += 10
        write_report(tmp_path, "generator-0", generator.pid, 1, doing="generating")
        assert supervisor.check_progress() is None
        clock.now += 10
        write_report(tmp_path, "generator-0", generator.pid, 2, doing="generating")
        failure = supervisor.check_progress()
    finally:
        spawned.stop()
    assert failure.startswith(f"learner (pid {learner.pid}) stalled: no progress for 10s")
    assert "\n    generator-0: generating since " in failure


def test_a_log_removed_under_the_run_does_not_end_supervision(tmp_path: Path) -> None:
    supervisor = supervisor_at(tmp_path)
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    supervisor.processes["buffer"] = process  # its log was never there
    failure = supervisor.failure()
    assert failure.startswith("buffer exited with status 3; last lines of ")
    assert "(cannot read it: No such file or directory)" in failure
