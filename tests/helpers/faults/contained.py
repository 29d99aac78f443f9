"""Scenarios whose faults are contained: the run trains on, then stops on SIGTERM."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers.faults.cases import (
    Case,
    lines_with,
    metric,
    metric_reaches,
    restarts,
    settle,
    stopped_cleanly,
)
from tests.helpers.faults.launch import (
    LONG,
    STALL_S,
    Launch,
    alive,
    generator_logs,
    generator_logs_bytes,
    log,
    start,
)
from tests.helpers.faults.ledger import final_ledger
from tests.helpers.faults.mounts import MountUnavailable, can_mount, made_read_only
from tests.helpers.faults.planted import (
    arm,
    claimed_at,
    reward_file,
    slow_chunk_env,
    slow_chunk_record,
)

SLOW_CHUNK_S = 5.0
"""Longer than the heartbeat timeout (3 s), shorter than run.stall_timeout_s (10 s)."""


REWARD_TIMEOUT_S = 2.0


def killed_generator(work: Path) -> Case:
    """kill -9 of generator-0 after step 3; the run trains on, then stops on SIGTERM.
    (``test_supervision.py`` backs this row; the table's figures come from here.)"""
    run = start(work / "killed-generator", LONG)
    case = Case("kill -9 of a generator")
    try:
        run.wait_for_step(3)
        fault = time.time()
        run.role("generator", index=0).kill()
        back = run.until("the restarted generator-0's samples", restarts(run, 1))
        case.seconds, case.held_up_s = back - fault, run.held_up_s(fault, back)
        case.message = lines_with(run.stderr(), "generator-0")
        case.went_on = True
        stopped_cleanly(run, case)
        case.notes["ledger"] = final_ledger(run.run_dir)
    finally:
        run.kill()
    return case


def suspend_generator(run: Launch, case: Case) -> None:
    """SIGSTOP generator-1: its heartbeats stop with it (the buffer hands its groups out
    again) and so does its progress (the watchdog replaces it after run.stall_timeout_s)."""
    victim = run.role("generator", index=1)
    before = metric(run, "generators_restarts_total")
    fault = time.time()
    victim.suspend()
    replaced = restarts(run, before + 1)
    back = run.until("the replaced generator-1's samples", replaced, STALL_S + 90)
    case.seconds, case.held_up_s = back - fault, run.held_up_s(fault, back)
    case.message = lines_with(run.stderr(), "generator-1")
    case.went_on = True
    case.notes["suspended process"] = victim


def contained_faults(work: Path) -> dict[str, Case]:
    """In one run with aim on, one after the other: a reward function that hangs, one that
    exits its process, one that prints 64 MiB; a generator chunk slowed past the heartbeat
    timeout; aim's repository turned read-only; a generator stopped with SIGSTOP. Each is
    contained and the run trains on; it stops on SIGTERM."""
    reward, triggers = reward_file(work)
    env, slow = slow_chunk_env(work, SLOW_CHUNK_S)
    run_dir = work / "contained"
    overrides = (LONG, "tracking.aim=true", f"reward.function={reward}:score",
                 f"reward.timeout_s={REWARD_TIMEOUT_S:g}")  # fmt: skip
    cases = {name: Case(fault) for name, fault in CONTAINED.items()}
    run = start(run_dir, *overrides, env=env)
    try:
        run.wait_for_step(3)
        with made_read_only(run_dir / ".aim") as make_read_only:
            for name, errors in (("hang", 1), ("crash", 2)):
                reward_fault(run, triggers, name, errors, cases[f"reward-{name}"])
            reward_flood(run, triggers, cases["reward-flood"])
            slow_chunk_over(run, slow, cases["slow-chunk"])
            aim_fault = break_aim(make_read_only, cases["tracker"])
            aim_failed(run, aim_fault, cases["tracker"])
            suspend_generator(run, cases["generator-stop"])
            stopped_cleanly(run, *cases.values())
        suspended = cases["generator-stop"].notes.pop("suspended process")
        cases["generator-stop"].notes["suspended process gone"] = not alive(suspended)
        note_contained(run, cases)
    finally:
        run.kill()
    return cases


def break_aim(make_read_only: Callable[[], None], case: Case) -> float:
    """Turn aim's repository read-only (as root); when that was."""
    if (why := can_mount()) is None:
        try:
            make_read_only()
        except MountUnavailable as error:  # aim kept a file open for writing throughout
            why = str(error)
    if why is not None:
        case.notes["not run"] = why
    return time.time()


def aim_failed(run: Launch, since: float, case: Case) -> None:
    """Wait until the learner counted aim's failure (it goes on without aim)."""
    case.went_on = True
    if "not run" in case.notes:
        return
    failed = run.until("aim's failure", metric_reaches(run, "tracking_aim_failures_total", 1))
    case.seconds, case.held_up_s = failed - since, run.held_up_s(since, failed)
    case.message = lines_with(log(run.run_dir, "learner"), "asyncrl.tracking")


def slow_chunk_over(run: Launch, trigger: Path, case: Case) -> None:
    """Slow the next chunk; wait until it ended and two more steps; what it cost the run."""
    counters = ("buffer_dropped_stale", "buffer_generators_replaced", "generators_restarts_total")
    before = {name: metric(run, name) for name in counters}
    trigger.touch()
    run.until("the slow chunk's end", lambda: slow_chunk_record(trigger) is not None)
    record = slow_chunk_record(trigger) or {}
    settle(run)
    case.seconds = record["ended"] - record["began"]
    case.held_up_s, case.went_on = run.held_up_s(record["began"], time.time()), True
    after = {name: metric(run, name) - before[name] for name in counters}
    case.notes |= {
        "dropped stale samples": after["buffer_dropped_stale"],
        "generators replaced by the buffer": after["buffer_generators_replaced"],
        "generators restarted": after["generators_restarts_total"],
    }


CONTAINED = {
    "reward-hang": "a reward function that hangs",
    "reward-crash": "a reward function that crashes (exits its process)",
    "reward-flood": "a reward function that floods its output (64 MiB)",
    "slow-chunk": f"a slow chunk ({SLOW_CHUNK_S:g} s engine call)",
    "tracker": "a tracker that fails (aim's repository turns read-only)",
    "generator-stop": "SIGSTOP of a generator (past the heartbeat timeout)",
}


def reward_fault(run: Launch, triggers: Path, name: str, errors: int, case: Case) -> None:
    """Arm the reward trigger ``name``; wait until its sample's error is counted."""
    arm(triggers, name)
    done = run.until(f"the reward {name}'s error", metric_reaches(
        run, "generators_reward_errors_total", errors))  # fmt: skip
    began = claimed_at(triggers, name)
    assert began is not None, f"the {name} trigger was never taken"
    case.seconds, case.held_up_s, case.went_on = done - began, run.held_up_s(began, done), True
    case.notes["reward errors"] = metric(run, "generators_reward_errors_total")
    case.message = lines_with(generator_logs(run.run_dir), "error:timeout" if name == "hang"
                              else "error:crashed")  # fmt: skip


def reward_flood(run: Launch, triggers: Path, case: Case) -> None:
    """Arm the flood; wait until it was printed and two more steps were trained."""
    before = generator_logs_bytes(run.run_dir)
    arm(triggers, "flood")
    noted = run.until("the flood's excerpt", lambda: FLOOD_NOTE in generator_logs(run.run_dir))
    began = claimed_at(triggers, "flood")
    assert began is not None, "the flood trigger was never taken"
    settle(run)
    case.seconds, case.went_on = noted - began, True
    case.held_up_s = run.held_up_s(began, time.time())
    case.notes["log growth bytes"] = generator_logs_bytes(run.run_dir) - before
    case.message = lines_with(generator_logs(run.run_dir), FLOOD_NOTE)


FLOOD_NOTE = "not shown"
"""In the generator's line on a reward worker's output: ``printed N bytes, M not shown``."""


def note_contained(run: Launch, cases: dict[str, Case]) -> None:
    """The run's figures that tell what the contained faults cost."""
    cases["tracker"].notes["aim failures"] = metric(run, "tracking_aim_failures_total")
    ledger_now = final_ledger(run.run_dir)
    for case in cases.values():
        case.notes["ledger"] = ledger_now
