"""The fault table of docs/running.md, a test per run of faults (:mod:`tests.helpers.faults`).

Each test runs one scenario of ``tests.helpers.faults`` against the real ``asyncrl launch``
and asserts what the table says of its rows: whether the run went on or stopped
with a message naming the fault and the resume command, the exit status, what
was lost (steps after the checkpoint, prompts by id), that resume continues, and
that no process of the run is left. Durations are measured by
``benchmarks/fault_table.py`` from the same scenarios, never asserted here.

Rows backed elsewhere, so not run again here: ``test_supervision.py`` (kill -9 of a
generator; SIGINT/SIGTERM; every process killed, then resumed), ``test_buffer_death.py``
(kill -9 of the buffer, then resumed), ``test_disk_full.py`` (the learner on a full
disk), ``tests/unit/rewards/test_rewards.py`` (the scorer under a hanging or crashing function).
"""

from __future__ import annotations

import pytest

from tests.helpers.faults import (
    EVERY,
    SLOW_CHUNK_S,
    Case,
    Ledger,
    MountUnavailable,
    contained_faults,
    stopping_faults,
    unwritable_run_dir,
)

pytestmark = pytest.mark.slow


def assert_nothing_lost_unnamed(ledger: Ledger) -> None:
    """Every prompt handed out was trained once, waits in the buffer, or is named as
    skipped in ``skipped_prompts.jsonl``."""
    assert ledger.repeated() == [], "a prompt trained twice"
    assert ledger.unaccounted() == [], "a prompt handed out and never named"
    assert ledger.listed == ledger.skipped


def assert_clean_stop(case: Case, status: int) -> None:
    assert case.status == status, case.message
    assert case.leftovers == [], f"{case.fault}: processes left"


def test_reward_chunk_tracker_and_generator_faults_are_contained_and_the_run_goes_on(tmp_path):
    cases = contained_faults(tmp_path)

    hang, crash, flood = cases["reward-hang"], cases["reward-crash"], cases["reward-flood"]
    assert "error:timeout" in hang.message and hang.notes["reward errors"] >= 1
    assert "error:crashed" in crash.message and crash.notes["reward errors"] >= 2
    assert flood.notes["log growth bytes"] < 1 << 20, "64 MiB printed reached the log"
    assert "not shown" in flood.message
    slow = cases["slow-chunk"]
    assert slow.seconds >= SLOW_CHUNK_S
    # its heartbeats went on: neither the buffer nor the watchdog replaced the replica
    assert slow.notes["generators replaced by the buffer"] == 0
    assert slow.notes["generators restarted"] == 0
    suspended = cases["generator-stop"]
    # SIGSTOP: the heartbeats stop too; the watchdog sees no progress and replaces it
    assert "generator-1" in suspended.message and "stalled" in suspended.message
    assert "generator-1 started again" in suspended.message
    assert suspended.notes["suspended process gone"]
    for case in cases.values():
        assert case.went_on, case.fault
        assert_clean_stop(case, 143)  # SIGTERM once every fault was seen contained
    assert_nothing_lost_unnamed(slow.notes["ledger"])
    tracker = cases["tracker"]
    if "not run" in tracker.notes:
        pytest.skip(f"the rest passed; aim's repository was not made read-only: "
                    f"{tracker.notes['not run']}")  # fmt: skip
    assert "aim" in tracker.message and "Read-only file system" in tracker.message
    assert tracker.notes["aim failures"] >= 1


def test_killed_rank_launcher_and_full_disk_stop_the_run_and_resume_goes_on(tmp_path):
    # with LoRA adapters, published alone: each resume reshards them (2 ranks -> 1) and
    # re-announces its version's digest, and no sample made with another adapter trains
    cases = stopping_faults(tmp_path, extra=("model.lora.rank=8",))
    rank, launcher = cases["learner-rank"], cases["launcher"]

    assert "learner rank 1 of 2 exited with status -9" in rank.message
    assert_clean_stop(rank, 1)
    # the last periodic checkpoint: rank 0 cannot write a final one without rank 1
    assert rank.checkpoint is not None and rank.checkpoint % EVERY == 0
    assert launcher.leftovers == [], "a process outlived the killed launcher"
    assert launcher.checkpoint == launcher.steps_done, "the learner's final checkpoint"
    if "disk" in cases:
        disk = cases["disk"]
        assert_clean_stop(disk, 1)
        assert "No space left on device" in disk.message
    for case in cases.values():
        if case is not launcher:
            assert "asyncrl launch --resume" in case.message, case.fault
        assert case.resumed_from == case.checkpoint, case.fault
        assert case.resumed == 0, case.fault
    assert_nothing_lost_unnamed(launcher.notes["ledger"])
    assert launcher.notes["adapter samples refused"] == 0.0
    if "disk" not in cases:
        pytest.skip("the rest passed; no tmpfs to fill (mounting needs root)")


def test_an_unwritable_run_directory_is_refused_in_one_line(tmp_path):
    try:
        case = unwritable_run_dir(tmp_path)
    except MountUnavailable as why:
        pytest.skip(f"no read-only filesystem: {why}")

    assert case.status == 2
    assert len(case.message.splitlines()) == 1, case.message
    assert case.notes["run dir"] in case.message
    assert not case.notes["created"]
    assert case.leftovers == []
