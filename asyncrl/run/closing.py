"""How a launch ends, local or on Ray: the stop, the exit status and the last words.

:func:`see_through` runs a started backend until the learner is done, a role
fails, a stop signal comes or the launcher itself fails; whichever it was, it
stops every role (:class:`~asyncrl.core.stop_signals.StopSignals` turns further
signals into a hurry) and closes with :func:`closing_message`: done, or why not
and how to resume.
"""

from __future__ import annotations

import json
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from asyncrl.core.paths import (
    CHECKPOINTS,
    COMPLETE,
    FINAL,
    FINAL_EVAL,
    checkpoint_step,
    latest_checkpoint,
)
from asyncrl.core.stop_signals import Interrupted, StopSignals
from asyncrl.run.console import ReplicaHealth, figure

DISK_NEARLY_FULL_BYTES = 16 * 2**20
"""A run that failed with less free space than this beside its run directory is told so:
the failing role's own last line may not have fit into its log."""


class LaunchError(RuntimeError):
    """The run cannot be placed or started; the message says why (a failure, not a bug)."""


class Console(Protocol):
    def note(self, message: str, error: bool = False) -> None: ...

    def update(self, health: list[ReplicaHealth]) -> None: ...


def see_through(
    console: Console,
    signals: StopSignals,
    run_dir: Path,
    *,
    start: Callable[[], None],
    supervise: Callable[[], str | None],
    stop: Callable[[], None],
    health: Callable[[], list[ReplicaHealth]],
    stopping: str = "every process",
    ended: str = "exited",
) -> int:
    """Start, supervise until the end, stop; say how it ended; the exit status.

    ``supervise`` returns the failure message, or None once the learner is done;
    ``stopping`` names what a stop signal stops, ``ended`` how a learner that
    left early did (``exited``, ``stopped``).
    """
    started = time.time()
    try:
        start()
        failure = supervise()
        status = 0 if failure is None else 1
    except LaunchError as error:
        failure, status = str(error), 1
    except Interrupted as interrupt:
        console.note(f"asyncrl: {interrupt}: stopping {stopping}", error=True)
        failure, status = None, 128 + interrupt.signum
    except Exception as error:  # the launcher's own fault: stop every role, say so
        console.note(traceback.format_exc().rstrip(), error=True)
        failure, status = f"the launcher failed while supervising: {error!r}", 1
    finally:
        signals.stopping = True  # from here a signal only hurries the stop
        stop()
    console.update(health())  # the steps logged while stopping
    if status == 0 and not wrote_final_policy(run_dir, started):
        failure, status = f"the learner {ended} before run.total_steps without an error", 1
    message = closing_message(run_dir, status, failure, time.time() - started)
    console.note(message, error=status != 0)
    return status


def wrote_final_policy(run_dir: Path, since: float) -> bool:
    """Whether the learner saved the final policy during this launch (a clean finish)."""
    final = run_dir / FINAL / "config.json"
    return final.exists() and final.stat().st_mtime >= since


def closing_message(run_dir: Path, status: int, failure: str | None, elapsed_s: float) -> str:
    """The last words of a launch (local or Ray): done, or why not and how to resume."""
    if status == 0:
        evaluated = final_eval_text(run_dir)
        return f"done in {elapsed_s:.1f}s{evaluated}; final policy in {run_dir / FINAL}"
    lines = [f"asyncrl: run failed: {failure}" if failure else "asyncrl: stopped"]
    if (full := disk_full_note(run_dir)) is not None:
        lines.append(full)
    if wrote_final_policy(run_dir, time.time() - elapsed_s):  # stopped while evaluating it
        lines.append(f"asyncrl: training had finished; the final policy is in {run_dir / FINAL}")
        return "\n".join(lines)
    if failure is None and (cut := cut_short_note(run_dir)) is not None:  # a stop's
        lines.append(cut)
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        lines.append("asyncrl: no complete checkpoint was written, so the run cannot be resumed")
    else:
        lines.append(
            f"asyncrl: continue the run from {checkpoint.name} with: "
            f"asyncrl launch --resume {run_dir}"
        )
    return "\n".join(lines)


def cut_short_note(run_dir: Path) -> str | None:
    """After a stop, one line when the newest checkpoint directory is incomplete (no
    ``COMPLETE``): the learner was killed before its stop checkpoint was saved, because
    the step it was in and the save took longer than ``learner.stop_timeout_s``.
    The steps after the last complete checkpoint run again on resume; the line says so,
    with the longest update this run logged, and what to raise. None otherwise."""
    folders = [p for p in (run_dir / CHECKPOINTS).glob("step-*") if checkpoint_step(p)]
    if not folders:
        return None
    newest = max(folders, key=checkpoint_step)
    if (newest / COMPLETE).exists():
        return None
    from asyncrl.run.status import read_metrics

    updates = [r.get("time_update_s") for r in read_metrics(run_dir)]
    longest = max((u for u in updates if isinstance(u, (int, float))), default=None)
    took = "" if longest is None else f" (an update of this run took up to {longest:.0f} s)"
    return (
        f"asyncrl: the checkpoint {newest.name} was cut short: the learner did not finish "
        f"its step and save within learner.stop_timeout_s of the stop{took}; raise "
        "learner.stop_timeout_s above a step and a save so a stop keeps its last step"
    )


def disk_full_note(run_dir: Path) -> str | None:
    """One line saying the run directory's filesystem is (nearly) full, or None."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free >= DISK_NEARLY_FULL_BYTES:
        return None
    return (
        f"asyncrl: the filesystem of {run_dir} is full ({free / 2**20:.1f} MiB free): writes "
        "fail with 'No space left on device'; free space there before resuming"
    )


def final_eval_text(run_dir: Path) -> str:
    """``; final eval reward 0.930 over 128 held-out samples`` from ``final/eval.json``
    (``eval.at_end``), or why there is none; empty when the run wrote no such file."""
    try:
        record = json.loads((run_dir / FINAL / FINAL_EVAL).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(record, dict):
        return ""
    if record.get("eval_reward_mean") is not None:
        return (
            f"; final eval reward {figure(record, 'eval_reward_mean', '.3f')} "
            f"over {figure(record, 'eval_samples', '.0f')} held-out samples"
        )
    return f"; no final eval ({record.get('skipped') or 'no reward'})"
