"""``RUN_DIR/skipped_prompts.jsonl``: every prompt the store gave up on, as it happens.

One line ``{"group_id", "reason", "step"}`` per prompt (a stale group out of
retries, a filtered group), so a user can find it. The checkpoint's
``buffer.json`` keeps the same record, and a resumed buffer rewrites the file
from it: skips after that checkpoint were undone with the rest of the lost work.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from asyncrl.buffer.durable import Skip, write_atomically

log = logging.getLogger("asyncrl.buffer")

SKIPPED_PROMPTS = "skipped_prompts.jsonl"
"""``RUN_DIR/SKIPPED_PROMPTS``: one JSON line per prompt handed out and given up on."""
SKIPS_LOGGED = 10
"""Group ids named in one log line about prompts skipped as stale (all are in the file)."""


class SkipFile:
    """Keeps ``skipped_prompts.jsonl`` equal to the store's :attr:`skipped` list; without
    a run directory it writes nothing."""

    def __init__(self, run_dir: Path | None):
        self.run_dir = run_dir
        self.written = 0
        """How many of the store's skips are in the file."""

    @property
    def path(self) -> Path | None:
        return None if self.run_dir is None else self.run_dir / SKIPPED_PROMPTS

    def start(self, skipped: list[Skip]) -> None:
        """Make the file hold exactly ``skipped`` (none in a new run; a restored
        checkpoint's on resume)."""
        if self.path is None or not (self.path.exists() or skipped):
            return
        write_atomically(self.path, "".join(_line(skip) for skip in skipped))
        self.written = len(skipped)

    def record(self, skipped: list[Skip], stale_retries: int) -> None:
        """Append the skips since the last call, one line each, and log the stale ones."""
        new = skipped[self.written :]
        if self.path is None or not new:
            return
        try:
            with self.path.open("a") as record:
                record.write("".join(_line(skip) for skip in new))
        except OSError as error:  # kept in the store and buffer.json; tried again next time
            log.error("could not record %d skipped prompt(s) in %s: %s", len(new), self.path, error)
            return
        self.written += len(new)
        stale = [skip.group_id for skip in new if skip.reason == "stale"]  # filtered: by design
        if stale:
            log.warning(
                "%d prompt(s) skipped as stale after buffer.stale_retries=%d retries (%s): "
                "recorded in %s",
                len(stale),
                stale_retries,
                _first_ids(stale),
                SKIPPED_PROMPTS,
            )


def _line(skip: Skip) -> str:
    return json.dumps(skip.as_dict()) + "\n"


def _first_ids(group_ids: list[int]) -> str:
    """Up to ``SKIPS_LOGGED`` ids for a log line, "..." if there are more."""
    shown = ", ".join(map(str, group_ids[:SKIPS_LOGGED]))
    return shown + ", ..." if len(group_ids) > SKIPS_LOGGED else shown
