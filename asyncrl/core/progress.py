"""What each role is doing, for the launcher's watchdog and for people: ``RUN_DIR/progress/``.

A process the launcher starts (:func:`asyncrl.run.roles.main`) calls :func:`start`
once; from then on its main loop calls :func:`beat` with what it is doing
(``waiting for a batch for step 12``, ``serving``, ``generating``). Each beat
that says the loop moved on (``advanced``, the default) counts; the launcher
reads ``RUN_DIR/progress/NAME.json`` and stops or replaces a role whose count
has not moved for ``run.stall_timeout_s`` (:mod:`asyncrl.run.watchdog`). Only the
main loop beats, never a thread of its own, so a hung loop shows as one.

The file is rewritten atomically (a temporary file, then a rename), at most once
a second unless what the role is doing changed, so a beat costs a clock read
in a hot loop. Writing it never raises: a full disk or a removed run directory
must not stop a role through its progress report; the first failure is logged,
and later ones are only counted. A process that never called :func:`start` (a
role started by hand, a test) beats into nothing.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("asyncrl.progress")

PROGRESS_DIR = "progress"
WRITE_EVERY_S = 1.0
"""A beat that changes nothing but the count is written at most this often."""
STARTING = "starting"
"""What a role is doing from its start until its main loop runs (loading the model)."""


@dataclass
class Report:
    """The content of one progress file (all times are ``time.time()`` of the role's host)."""

    name: str
    role: str
    pid: int
    host: str
    started: float
    """When the process began reporting."""
    doing: str
    detail: str
    """Numbers that change while ``doing`` stays (``12 ready samples, 2 generators``)."""
    since: float
    """When it began ``doing``."""
    advances: int
    """Beats that said the loop moved on; the watchdog watches this count."""
    advanced_at: float | None
    beat_at: float
    """The latest beat written."""
    patience_s: float = 0.0
    """How long ``doing`` may legitimately last without an advance (the final eval's
    wait); the watchdog allows the longer of this and ``run.stall_timeout_s``."""
    waiting_for: str = ""
    """``generators`` while ``doing`` waits on them (the learner waiting for a batch): a
    generator starting or being restarted is then not this role's stall. ``learner`` while
    it waits on the learner (a generator fetching weights): a frozen learner is then the
    learner's stall, not this role's."""

    def what(self) -> str:
        """``doing (detail)``."""
        return f"{self.doing} ({self.detail})" if self.detail else self.doing


def progress_path(run_dir: Path, name: str) -> Path:
    return run_dir / PROGRESS_DIR / f"{name}.json"


class Progress:
    """One process's progress file; :meth:`beat` from its main loop."""

    def __init__(self, run_dir: Path, name: str, role: str, clock: Callable[[], float] = time.time):
        self.path = progress_path(run_dir, name)
        self.clock = clock
        now = clock()
        self.report = Report(
            name=name,
            role=role,
            pid=os.getpid(),
            host=socket.gethostname(),
            started=now,
            doing="",
            detail="",
            since=now,
            advances=0,
            advanced_at=None,
            beat_at=now,
        )
        self.written_at: float | None = None
        self.write_errors = 0
        """Writes that failed (the first is logged)."""

    def beat(
        self,
        doing: str,
        advanced: bool = True,
        *,
        detail: Callable[[], str] | None = None,
        patience_s: float = 0.0,
        waiting_for: str = "",
    ) -> None:
        """Record ``doing``; ``advanced`` when the loop moved on. ``detail`` is called
        only when the file is written (the numbers a hot loop should not format);
        ``patience_s`` and ``waiting_for``: see :class:`Report`."""
        report, now = self.report, self.clock()
        state = (doing, patience_s, waiting_for)
        changed = state != (report.doing, report.patience_s, report.waiting_for)
        if changed:
            report.doing, report.patience_s, report.waiting_for = state
            report.since = now
        if advanced:
            report.advances += 1
            report.advanced_at = now
        if changed or self.written_at is None or now - self.written_at >= WRITE_EVERY_S:
            self._write(now, detail)

    def _write(self, now: float, detail: Callable[[], str] | None) -> None:
        self.written_at = now
        report = self.report
        report.beat_at = now
        temporary = self.path.with_name(f".{self.path.name}.{report.pid}.tmp")
        try:
            report.detail = detail() if detail is not None else ""
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(asdict(report)))
            os.replace(temporary, self.path)
        except Exception as error:  # OSError mostly; a detail that fails must not kill either
            self.write_errors += 1
            if self.write_errors == 1:
                log.warning("cannot write the progress report %s: %s", self.path, error)


_current: Progress | None = None


def start(run_dir: Path, name: str, role: str) -> Progress:
    """Report this process's progress as ``name`` from now on (it is starting)."""
    global _current
    _current = Progress(run_dir, name, role)
    _current.beat(STARTING, advanced=False)
    return _current


def beat(
    doing: str,
    advanced: bool = True,
    *,
    detail: Callable[[], str] | None = None,
    patience_s: float = 0.0,
    waiting_for: str = "",
) -> None:
    """:meth:`Progress.beat` of this process's report; nothing without :func:`start`."""
    if _current is not None:
        _current.beat(
            doing, advanced, detail=detail, patience_s=patience_s, waiting_for=waiting_for
        )


_TYPES = {
    "name": str, "role": str, "pid": int, "host": str, "started": (int, float), "doing": str,
    "detail": str, "since": (int, float), "advances": int, "advanced_at": (int, float, type(None)),
    "beat_at": (int, float), "patience_s": (int, float), "waiting_for": str,
}  # fmt: skip


def read(run_dir: Path, name: str) -> Report | None:
    """``name``'s report, or None when there is none or it is not one (never raises:
    the launcher reads these on every tick)."""
    try:
        data = json.loads(progress_path(run_dir, name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not set(_TYPES) <= set(data):
        return None
    fields = {key: data[key] for key in _TYPES}  # a newer writer's extra keys are ignored
    for key, kind in _TYPES.items():
        value = fields[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return None
    return Report(**fields)
