"""The run's ledger: which prompts were trained, skipped or are still waiting, read from
the run directory and a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.core.paths import latest_checkpoint


def trained_groups(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the group ids trained in it; after a resume the last record of a step counts."""
    steps: dict[int, list[int]] = {}
    path = run_dir / "trained_groups.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            steps[record["step"]] = record["group_ids"]
    return steps


@dataclass
class Ledger:
    """Where each prompt handed out (``0 .. cursor-1``) ended, at a checkpoint."""

    trained: list[int] = field(repr=False)
    waiting: list[int] = field(repr=False)
    skipped: list[dict]
    cursor: int
    listed: list[dict]
    """``RUN_DIR/skipped_prompts.jsonl`` when the ledger was taken (it should be ``skipped``)."""

    def repeated(self) -> list[int]:
        """Prompts trained twice (in the steps up to the checkpoint)."""
        seen: set[int] = set()
        return sorted(g for g in self.trained if g in seen or seen.add(g))

    def unaccounted(self) -> list[int]:
        """Prompts handed out and neither trained, waiting nor recorded as skipped."""
        named = {*self.trained, *self.waiting, *(s["group_id"] for s in self.skipped)}
        return sorted(set(range(self.cursor)) - named)


def ledger(run_dir: Path, checkpoint: Path) -> Ledger:
    """The prompts' fate at ``checkpoint``: trained in its steps, waiting, skipped."""
    state = json.loads((checkpoint / "buffer.json").read_text())
    step = int(checkpoint.name.removeprefix("step-"))
    steps = trained_groups(run_dir)
    trained = [group for s in range(step) for group in steps.get(s, [])]
    return Ledger(trained, state["unfinished_groups"], state.get("skipped_groups", []),
                  state["cursor"], skipped_prompts(run_dir))  # fmt: skip


def skipped_prompts(run_dir: Path) -> list[dict]:
    """``RUN_DIR/skipped_prompts.jsonl``: the prompts given up on, by id."""
    path = run_dir / "skipped_prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest complete checkpoint, None without one."""
    checkpoint = latest_checkpoint(run_dir)
    return None if checkpoint is None else int(checkpoint.name.removeprefix("step-"))


def final_ledger(run_dir: Path) -> Ledger:
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None, f"no complete checkpoint in {run_dir}"
    return ledger(run_dir, checkpoint)
