"""When the learner checkpoints, and who completes a checkpoint (the format: :mod:`.checkpoint`).

Every rank writes its shards of checkpoint ``V`` every ``learner.checkpoint_every``
versions, and on a stop for the last complete step unless it is written already.
Rank 0 then completes it (:class:`Completer`): the buffer's part (or, the buffer
dead, its own rebuild of it: :func:`.checkpoint.complete_without_buffer`),
``COMPLETE``, and the retention of ``learner.keep_checkpoints``. The other ranks'
completer does nothing (:class:`NoCompleter`). A checkpoint of non-finite
weights is refused on every rank alike, and never completed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from asyncrl.core import progress
from asyncrl.core.paths import checkpoint_dir
from asyncrl.learner import buffer_client, checkpoint
from asyncrl.learner.buffer_client import BufferStateNotSaved
from asyncrl.learner.policy import Learner

log = logging.getLogger("asyncrl.learner")


class BufferState(Protocol):
    """What completing a checkpoint needs of the buffer (:class:`.BufferClient`)."""

    def save_state(self, step: int, timeout_s: float | None = None) -> None: ...


class Completer:
    """Rank 0's share of a checkpoint every rank has written: the buffer's part,
    ``COMPLETE``, and deleting what ``learner.keep_checkpoints`` no longer keeps."""

    def __init__(self, buffer: BufferState, run_dir: Path, keep: int | None):
        self.buffer = buffer
        self.run_dir = run_dir
        self.keep = keep

    def complete(self, path: Path, version: int, buffer_timeout_s: float | None) -> None:
        try:
            self.buffer.save_state(version, buffer_timeout_s)
        except BufferStateNotSaved as error:
            # the learner's state is intact: complete the checkpoint without the buffer
            if not checkpoint.complete_without_buffer(self.run_dir, path, version, str(error)):
                return
        checkpoint.mark_complete(path)
        log.info("checkpoint %s", path)
        checkpoint.prune(self.run_dir, self.keep, path)


class NoCompleter:
    """The completer of every rank but 0: rank 0 completes every checkpoint."""

    def complete(self, path: Path, version: int, buffer_timeout_s: float | None) -> None:
        pass


class Checkpointer:
    """Writes this rank's part of the checkpoints that are due, and the final policy."""

    def __init__(self, learner: Learner, run_dir: Path, completer: Completer | NoCompleter):
        self.learner = learner
        self.run_dir = run_dir
        self.completer = completer
        self.every = learner.config.learner.checkpoint_every
        self.saved = learner.version
        """The newest version checkpointed (or resumed from, or 0 at the start)."""

    def after_step(self) -> None:
        """Checkpoint if this version is due (every ``learner.checkpoint_every``)."""
        if self.every and self.learner.version % self.every == 0:
            self.save()

    def on_stop(self) -> None:
        """Asked to stop: checkpoint the last complete step unless it is already, waiting
        for the buffer's part at most ``FINAL_SAVE_TIMEOUT_S``."""
        if self.learner.version > self.saved:
            self.save(buffer_timeout_s=buffer_client.FINAL_SAVE_TIMEOUT_S)

    def save(self, buffer_timeout_s: float | None = None) -> None:
        """Checkpoint the current version (collective); ``buffer_timeout_s`` bounds the wait
        for the buffer's part (default: the buffer client's)."""
        version = self.learner.version
        progress.beat(f"checkpointing step {version}")
        path = checkpoint_dir(self.run_dir, version)
        if self.learner.save_checkpoint(path):  # False: not finite, refused and logged
            self.completer.complete(path, version, buffer_timeout_s)
        self.saved = version

    def save_final_policy(self) -> None:
        """The trained policy in Hugging Face format in ``RUN_DIR/final`` (collective)."""
        progress.beat("saving the final policy")
        self.learner.save_pretrained(self.run_dir / "final")
