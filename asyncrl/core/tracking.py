"""Metrics out of the learner: one JSON line per step, and aim when it is on.

``metrics.jsonl`` keeps the flat names the docs use (``buffer_dropped_stale``);
aim gets the same values namespaced by their first word (``buffer/dropped_stale``).
A value with nothing to measure this step (NaN: no token sampled with the current
weights for ``logprob_mismatch``) is ``null`` in the JSON line, which stays strict
JSON for any reader, and is left out of aim.
With tracking off, :class:`NullAim` stands in so callers never branch.

The two fail differently, on purpose:

- ``metrics.jsonl`` (and ``trained_groups.jsonl``, :class:`JsonLines`) is the run's
  record: a line that cannot be written (a full disk) raises
  :class:`RecordWriteError`, one line naming the file and the OS error, and the
  learner stops rather than train on unrecorded.
- aim is a viewer: its first exception (opening the repo, tracking, closing)
  turns it off for the rest of the run with one warning (:class:`GuardedAim`;
  ``tracking_aim_enabled``, ``tracking_aim_failures_total`` in each line when aim
  was asked for). Its close runs in a daemon thread for at most
  ``AIM_CLOSE_TIMEOUT_S``, and aim's own exit handler, which waits without bound
  for closes that raise on a full disk (the learner once hung there for ever),
  is disarmed once the tracker closed it.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("asyncrl.tracking")

AIM_CLOSE_TIMEOUT_S = 10.0
"""How long closing aim may take before it is abandoned (its last values may be lost)."""
AIM_CLOSE_HURRIED_S = 1.0
"""The same when the learner is ending on an error: on a full disk aim's close hangs."""

NAMESPACES = (
    "buffer",
    "learner",
    "generator",
    "generators",
    "reward",
    "staleness",
    "importance",
    "time",
    "loss",
    "eval",
    "tracking",
)


def aim_name(key: str) -> str:
    head, _, tail = key.partition("_")
    return f"{head}/{tail}" if head in NAMESPACES and tail else key


class RecordWriteError(RuntimeError):
    """A file of the run's record could not be written; the message is one line."""

    def __init__(self, path: Path, error: OSError):
        reason = error.strerror or str(error)
        super().__init__(f"cannot write {path}: {reason} (errno {error.errno}); the learner stops")
        self.path = path
        self.errno = error.errno


class JsonLines:
    """An append-only JSON-lines file of the run's record, flushed line by line.

    A line that cannot be written raises :class:`RecordWriteError`; closing after
    that drops what could not be written instead of raising again (which would
    hide the first error behind a second one).
    """

    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("a")
        self.failed = False

    def write(self, record: dict[str, Any]) -> None:
        text = json.dumps(record, allow_nan=False) + "\n"
        try:
            self.file.write(text)
            self.file.flush()
        except OSError as error:
            self.failed = True
            raise RecordWriteError(self.path, error) from error

    def close(self) -> None:
        try:
            self.file.close()  # closes the descriptor even when the last flush fails
        except OSError as error:
            if not self.failed:
                raise RecordWriteError(self.path, error) from error


class NullAim:
    enabled = False

    def track(self, *args: Any, **kwargs: Any) -> None:
        pass

    def track_text(self, *args: Any, **kwargs: Any) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def close(self, timeout_s: float | None = None) -> None:
        pass


def open_aim(run_dir: Path, experiment: str, hparams: dict[str, Any]):
    from aim import Run

    run = Run(
        repo=str(run_dir),
        experiment=experiment,
        system_tracking_interval=None,
        capture_terminal_logs=False,
    )
    run["hparams"] = hparams
    return run


class GuardedAim:
    """An aim run that never stops training: its first exception turns it off (one
    warning naming the error, counted), and closing it is bounded."""

    def __init__(self, open_run: Callable[[], Any], close_timeout_s: float = AIM_CLOSE_TIMEOUT_S):
        self.close_timeout_s = close_timeout_s
        self.failures = 0
        self.run: Any = None
        self.run = self._guarded("open its repository", open_run)

    @property
    def enabled(self) -> bool:
        return self.run is not None

    def track(self, value: Any, **kwargs: Any) -> None:
        if self.run is not None:
            self._guarded("track a value", lambda: self.run.track(value, **kwargs))

    def track_text(self, text: str, **kwargs: Any) -> None:
        if self.run is not None:
            self._guarded("track a text", lambda: self.run.track(_aim_text(text), **kwargs))

    def stats(self) -> dict[str, float]:
        return {
            "tracking_aim_enabled": float(self.enabled),
            "tracking_aim_failures_total": float(self.failures),
        }

    def close(self, timeout_s: float | None = None) -> None:
        """Close the run, waiting at most ``timeout_s`` (default ``close_timeout_s``); a
        failure is one warning."""
        run, self.run = self.run, None
        if run is None:
            return
        outcome = close_within(run, self.close_timeout_s if timeout_s is None else timeout_s)
        if outcome is not None:
            self.failures += 1
            log.warning("aim: %s; its last values may be missing", outcome)
        disarm_aim_exit()

    def _guarded(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:  # aim's errors have no common base (rocksdb, sqlite, OS)
            self._fail(what, error)
            return None

    def _fail(self, what: str, error: Exception) -> None:
        """Turn aim off: warn once, close it in the background, never wait for it."""
        self.failures += 1
        run, self.run = self.run, None
        log.warning(
            "aim failed to %s (%s: %s); aim is off for the rest of this run "
            "(metrics.jsonl is still written)",
            what,
            type(error).__name__,
            _one_line(error),
        )
        if run is not None:
            _start_daemon(lambda: _quietly(run.close))
        disarm_aim_exit()


def close_within(run: Any, timeout_s: float) -> str | None:
    """Call ``run.close()`` in a daemon thread for at most ``timeout_s``; None if it
    returned in time, else what went wrong (the thread is abandoned on a timeout)."""
    errors: list[BaseException] = []

    def close() -> None:
        try:
            run.close()
            _close_aim_leftovers()
        except BaseException as error:
            errors.append(error)

    thread = _start_daemon(close)
    thread.join(timeout_s)
    if thread.is_alive():
        return f"closing did not finish within {timeout_s:g}s and was abandoned"
    if errors:
        return f"closing failed ({type(errors[0]).__name__}: {_one_line(errors[0])})"
    return None


def _close_aim_leftovers() -> None:
    """Close what aim still holds open (its repo, containers), as its exit handler would;
    done here, within the bound, the exit handler finds nothing left to wait for."""
    from aim.ext.cleanup import AutoClean

    cleanup = getattr(AutoClean, "_cleanup", None)
    if cleanup is not None:
        cleanup()


def disarm_aim_exit() -> None:
    """Drop what aim would still close at interpreter exit.

    aim's exit handler closes every repo and container left open and waits, without
    bound, for a signal that a close which raises never sends: after a full disk the
    learner's exit hung there for ever. Once the tracker closed (or gave up on) the
    run, nothing is left that needs aim's exit handler.
    """
    try:
        from aim.ext.cleanup import AutoClean
    except ImportError:
        return
    for _, finalizer in list(AutoClean._finalizers.values()):
        finalizer.detach()


def _quietly(call: Callable[[], Any]) -> None:
    """``call()``, its error only logged at debug level (it follows one already warned of)."""
    try:
        call()
    except Exception as error:
        log.debug("closing aim after its failure failed too: %r", error)


def _start_daemon(target: Callable[[], Any]) -> threading.Thread:
    thread = threading.Thread(target=target, name="aim-close", daemon=True)
    thread.start()
    return thread


def _aim_text(text: str) -> Any:
    from aim import Text

    return Text(text)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


class Tracker:
    def __init__(self, run_dir: Path, experiment: str, hparams: dict[str, Any], use_aim: bool):
        self.path = run_dir / "metrics.jsonl"
        self.lines = JsonLines(self.path)
        self.aim: NullAim | GuardedAim = NullAim()
        if use_aim:
            self.aim = GuardedAim(lambda: open_aim(run_dir, experiment, hparams))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One line of ``metrics.jsonl`` (RecordWriteError if it cannot be written), then aim."""
        metrics = {**metrics, **self.aim.stats()}
        measured = {key: value for key, value in metrics.items() if not _unmeasured(value)}
        self.lines.write({"step": step, **{key: measured.get(key) for key in metrics}})
        for key, value in measured.items():
            self.aim.track(value, name=aim_name(key), step=step)

    def log_generations(self, step: int, generations: list[dict[str, Any]]) -> None:
        """A few samples of the step as aim text (``generations``), one per context index."""
        for index, generation in enumerate(generations):
            if not self.aim.enabled:
                return
            text = "\n".join(f"{key}: {value}" for key, value in generation.items())
            self.aim.track_text(text, name="generations", step=step, context={"sample": index})

    def close(self, hurry: bool = False) -> None:
        """Close both; aim first and bounded (``hurry``: the learner is ending on an error,
        aim gets ``AIM_CLOSE_HURRIED_S``), so a failing record file cannot skip it."""
        hurried = hurry or self.lines.failed
        self.aim.close(AIM_CLOSE_HURRIED_S if hurried else None)
        self.lines.close()


def _unmeasured(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)
