"""Where things live in a run directory; shared by every role, imports nothing heavy."""

from __future__ import annotations

import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
BUFFER_STATE = "buffer.json"
COMPLETE = "COMPLETE"
"""Written last into a checkpoint directory; one without it (a crash mid-save) is ignored."""
FINAL = "final"
"""The final policy, in Hugging Face format, written once ``run.total_steps`` are trained."""
FINAL_EVAL = "eval.json"
"""In ``RUN_DIR/final/``: the final eval round's metrics.jsonl line, or why there is none."""
TRAINED_GROUPS = "trained_groups.jsonl"
"""One line per learner step: ``{"step": 4, "version": 5, "group_ids": [...]}`` (steps as in
metrics.jsonl). After a resume, the last line of a step is the one that counts."""
WEIGHTS_SHM_POINTER = "weights_shm"
"""The file in the run dir naming the run's shared-memory weights segment, while it exists."""
LEARNER_STORE_ENV = "ASYNCRL_LEARNER_STORE"
"""The environment variable naming the file through which learner ranks on one machine
form their process group (:func:`asyncrl.learner.distributed.init`); set by the launcher,
in a private directory outside the run directory."""
_STEP = re.compile(r"^step-(\d+)$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """The checkpoint written after learner step ``step`` (counting from 1)."""
    return run_dir / CHECKPOINTS / f"step-{step:06d}"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint directory named ``step-NNNNNN``; None for any other name."""
    match = _STEP.match(path.name)
    return int(match[1]) if match else None


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """A run's complete checkpoints, oldest first."""
    complete = [
        path
        for path in (run_dir / CHECKPOINTS).glob("step-*")
        if checkpoint_step(path) is not None and (path / COMPLETE).exists()
    ]
    return sorted(complete, key=checkpoint_step)


def latest_checkpoint(run_dir: Path, before: int | None = None) -> Path | None:
    """The newest complete checkpoint of a run (of a step below ``before``, if given), or None."""
    complete = complete_checkpoints(run_dir)
    if before is not None:
        complete = [path for path in complete if checkpoint_step(path) < before]
    return complete[-1] if complete else None


def replica_name(pool: str, index: int) -> str:
    """A generator replica's process name: its log is ``logs/NAME.log`` and its scratch
    directory ``RUN_DIR/NAME``; ``generator-0`` in the default pool, ``generator-fast-0``."""
    return f"generator-{index}" if pool == "default" else f"generator-{pool}-{index}"
