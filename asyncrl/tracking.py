"""Metrics out of the learner: one JSON line per step, and aim when it is on.

``metrics.jsonl`` keeps the flat names the docs use (``buffer_dropped_stale``);
aim gets the same values namespaced by their first word (``buffer/dropped_stale``).
A value with nothing to measure this step (NaN: no token sampled with the current
weights for ``logprob_mismatch``) is ``null`` in the JSON line, which stays strict
JSON for any reader, and is left out of aim.
With tracking off, :class:`NullAim` stands in so callers never branch.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("asyncrl.tracking")

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
)


def aim_name(key: str) -> str:
    head, _, tail = key.partition("_")
    return f"{head}/{tail}" if head in NAMESPACES and tail else key


class NullAim:
    def track(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
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


class Tracker:
    def __init__(self, run_dir: Path, experiment: str, hparams: dict[str, Any], use_aim: bool):
        self.path = run_dir / "metrics.jsonl"
        self.file = self.path.open("a")
        self.aim = open_aim(run_dir, experiment, hparams) if use_aim else NullAim()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        measured = {key: value for key, value in metrics.items() if not _unmeasured(value)}
        line = {"step": step, **{key: measured.get(key) for key in metrics}}
        self.file.write(json.dumps(line, allow_nan=False) + "\n")
        self.file.flush()
        for key, value in measured.items():
            self.aim.track(value, name=aim_name(key), step=step)

    def log_generations(self, step: int, generations: list[dict[str, Any]]) -> None:
        """A few samples of the step as aim text (``generations``), one per context index."""
        if isinstance(self.aim, NullAim):
            return
        from aim import Text

        for index, generation in enumerate(generations):
            text = "\n".join(f"{key}: {value}" for key, value in generation.items())
            self.aim.track(Text(text), name="generations", step=step, context={"sample": index})

    def close(self) -> None:
        self.file.close()
        self.aim.close()


def _unmeasured(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)
