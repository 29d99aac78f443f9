"""Scenarios whose faults stop the run: each is resumed, and the last resume trains to the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psutil

from tests.helpers.faults.cases import Case, lines_with
from tests.helpers.faults.launch import LONG, Launch, gone, log, resume, resumed_from, start
from tests.helpers.faults.ledger import checkpoint_step, final_ledger, skipped_prompts
from tests.helpers.faults.mounts import Filler, maybe_small_disk, unwritable


def stopping_faults(work: Path, size_mb: int = 64, extra: tuple[str, ...] = ()) -> dict[str, Case]:
    """One run, aim on (the quickstart's default), checkpoints every 4 steps, on a small
    tmpfs: kill -9 of learner rank 1 of 2, resume on one rank (DCP reshards); kill -9 of
    the launcher, resume; the disk kept full to its last page, then freed, resume to
    the end. Without root (no tmpfs) it runs in a plain directory, without the disk fault.
    ``extra``: more overrides of the run (every resume keeps them: they are its config)."""
    cases = {
        "learner-rank": Case("kill -9 of a learner rank (rank 1 of 2)"),
        "launcher": Case("kill -9 of the launcher"),
        "disk": Case("disk full (the run directory's filesystem; aim on)"),
    }
    outputs = work / "launches"
    with maybe_small_disk(work / "disk", size_mb) as why:
        run_dir = work / "disk" / "run"
        overrides = (LONG, "tracking.aim=true", "learner.world_size=2",
                     f"learner.checkpoint_every={EVERY}", *extra)  # fmt: skip
        run = start(run_dir, *overrides, logs=outputs)
        kill_role(run, cases["learner-rank"], 6, lambda: run.role("learner", rank=1))
        run = resume(run_dir, "learner.world_size=1", logs=outputs)
        kill_launcher(run, cases["launcher"], cases["learner-rank"])
        last = cases["launcher"]
        if why is None:
            fill_the_disk(resume(run_dir, logs=outputs), cases["disk"], last)
            last = cases["disk"]
        else:
            del cases["disk"]
        resume_to_the_end(run_dir, last, list(cases.values()), outputs)
    return cases


EVERY = 4
"""learner.checkpoint_every of the runs that stop."""


def resume_to_the_end(run_dir: Path, last: Case, cases: list[Case], outputs: Path) -> None:
    """Resume to the checkpoint after ``last``'s; each case gets the exit status and the
    prompts' ledger at that final checkpoint."""
    total = ((last.checkpoint or 0) // EVERY + 1) * EVERY  # a checkpoint at the last step
    run = resume(run_dir, f"run.total_steps={total}", logs=outputs)
    try:
        status = run.wait()
        last.resumed_from = resumed_from(run)
    finally:
        run.kill()
    finished = final_ledger(run_dir) if status == 0 else None
    refused = max((r.get("buffer_refused_adapter") or 0.0 for r in run.metrics()), default=0.0)
    for case in cases:
        case.resumed = status
        case.notes["ledger"] = finished
        case.notes["final step"] = run.trained_to()
        case.notes["adapter samples refused"] = refused  # of every launch of the run


def kill_role(
    run: Launch,
    case: Case,
    after: int,
    victim: Callable[[], psutil.Process],
    previous: Case | None = None,
) -> None:
    """After ``after`` steps of this launch, kill -9 ``victim()``; the launcher's answer.
    This launch resumed the run after ``previous``: where from goes into that case."""
    try:
        run.wait_for_new_steps(after)
        if previous is not None:
            previous.resumed_from = resumed_from(run)
        fault = time.time()
        victim().kill()
        stopped(run, case, fault)
    finally:
        run.kill()


def stopped(run: Launch, case: Case, fault: float) -> None:
    """Wait for the launcher's exit after ``fault``; what it said, lost and left."""
    case.status = run.wait()
    case.notes["exits after s"] = exit_delays(run, fault)
    case.leftovers = run.leftovers()
    case.seconds = (run.ended or time.time()) - fault
    case.message = lines_with(run.stderr(), "run failed", "continue the run", "cannot be",
                              "No space")  # fmt: skip
    case.notes["stderr"] = run.stderr()[-3000:]  # what the user saw
    case.steps_done = run.trained_to()
    case.checkpoint = checkpoint_step(run.run_dir)
    case.skipped = skipped_prompts(run.run_dir)


def exit_delays(launch: Launch, since: float) -> dict[str, float]:
    """Seconds from ``since`` until the last process of each role that was running then
    had exited (a role with a process still running is left out)."""
    delays: dict[str, float] = {}
    for pid, role in sorted(launch.roles.items(), key=lambda item: item[1]):
        exited = launch.exits.get(pid, float("inf"))
        if exited > since:
            delays[role] = max(delays.get(role, 0.0), round(exited - since, 1))
    return {role: delay for role, delay in delays.items() if delay != float("inf")}


def kill_launcher(run: Launch, case: Case, previous: Case) -> None:
    """After 3 steps of this launch, kill -9 the launcher; wait for its processes to go.
    This launch resumed the run after ``previous``: where from goes into that case."""
    try:
        run.wait_for_new_steps(3)
        previous.resumed_from = resumed_from(run)
        for process in run.tree():
            run.note(process)
        fault = time.time()
        run.process.kill()
        case.seconds = gone(run) - fault
        case.notes["exits after s"] = exit_delays(run, fault)
        case.leftovers = run.leftovers()
        case.message = lines_with(log(run.run_dir, "learner"), "signal", "checkpoint", "buffer")
        case.steps_done = run.trained_to()
        case.checkpoint = checkpoint_step(run.run_dir)
        case.skipped = skipped_prompts(run.run_dir)
    finally:
        run.kill()


def fill_the_disk(run: Launch, case: Case, previous: Case) -> None:
    """After 3 steps of this launch, fill the run directory's disk and keep it full until
    the launcher exits; the launcher's answer. Then the space is freed (as an operator
    would, before resuming)."""
    try:
        run.wait_for_new_steps(3)
        previous.resumed_from = resumed_from(run)
        with Filler(run.run_dir.parent) as filler:
            fault = time.time()
            stopped(run, case, fault)
            case.notes["filler bytes"] = filler.written
    finally:
        run.kill()


def killed_buffer(work: Path) -> Case:
    """kill -9 of the buffer after step 6, then resume to the end.
    (``test_buffer_death.py`` backs this row; the table's figures come from here.)"""
    run_dir = work / "killed-buffer"
    case = Case("kill -9 of the buffer")
    run = start(run_dir, LONG, f"learner.checkpoint_every={EVERY}")
    kill_role(run, case, 6, lambda: run.role("buffer"))
    resume_to_the_end(run_dir, case, [case], work / "launches")
    return case


def unwritable_run_dir(work: Path) -> Case:
    """``--run-dir`` on a read-only filesystem (as root; a directory of mode 0500 else)."""
    case = Case("an unwritable run directory")
    outputs = work / "launches"
    with unwritable(work / "unwritable") as parent:
        run = start(parent / "run", "run.total_steps=5", logs=outputs)
        try:
            case.status = run.wait(60)
            case.seconds = (run.ended or time.time()) - run.started
            case.leftovers = run.leftovers()
            case.message = run.stderr().strip()
            case.notes["stdout"] = run.stdout().strip()
            case.notes["created"] = (parent / "run").exists()
            case.notes["run dir"] = str(parent / "run")
        finally:
            run.kill()
    return case
