"""Where things live in a run directory; shared by every role, imports nothing heavy."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
BUFFER_STATE = "buffer.json"
COMPLETE = "COMPLETE"
"""Written last into a checkpoint directory; one without it (a crash mid-save) is ignored."""
_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """The checkpoint written after learner step ``step`` (counting from 1)."""
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    candidates = [
        path
        for path in (run_dir / CHECKPOINTS).glob("step-*")
        if _STEP.match(path.name) and (path / COMPLETE).exists()
    ]
    return max(candidates, key=lambda path: int(_STEP.match(path.name)[1]), default=None)


def replica_name(pool: str, index: int) -> str:
    """A generator replica's process name: its log is ``logs/NAME.log`` and its scratch
    directory ``RUN_DIR/NAME``; ``generator-0`` in the default pool, ``generator-fast-0``."""
    return f"generator-{index}" if pool == "default" else f"generator-{pool}-{index}"
