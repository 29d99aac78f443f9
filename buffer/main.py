"""The buffer process: build the store a run's config describes, resume it, serve.

``asyncrl.run.roles`` starts the buffer role with :func:`run`; tests and benchmarks
build the same store with :func:`build_store`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import uvloop

from asyncrl.buffer.service import BufferService
from asyncrl.buffer.store import BufferStore
from asyncrl.config import Config
from asyncrl.core.messages import WorkItem
from asyncrl.core.paths import BUFFER_STATE
from asyncrl.core.transport import tcp

log = logging.getLogger("asyncrl.buffer")


def build_store(
    config: Config,
    make_item: Callable[[int], WorkItem],
    eval_items: Sequence[WorkItem] | None = None,
) -> BufferStore:
    """The store a run's ``buffer`` section describes, handing out ``make_item(index)``;
    eval rounds run on ``eval_items`` (None: the ``eval`` section's prompts)."""
    if eval_items is None:
        from asyncrl.generation.tasks import eval_work_items

        eval_items = eval_work_items(config)
    return BufferStore(config.buffer, make_item, config.algorithm.samples_per_step, eval_items)


def restore_from(store: BufferStore, checkpoint: Path) -> None:
    """Restore ``store`` from ``checkpoint``'s buffer.json; a file that cannot be read or
    is not a valid state stops the buffer with one line naming it (SystemExit)."""
    path = checkpoint / BUFFER_STATE
    try:
        store.restore(json.loads(path.read_text()))
    except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
        raise SystemExit(f"cannot resume from {path}: {error}") from None
    log.info(
        "resumed from %s: cursor %d, %d unfinished groups handed out first, %d prompts "
        "skipped before, %d groups trained since it was written",
        checkpoint,
        store.cursor,
        len(store.requeue),
        len(store.skipped),
        store.counters["restored_skipped_trained"] + len(store.new_prompts.trained_ahead),
    )


def run(config: Config, run_dir: Path, resume_from: Path | None = None) -> None:
    """Serve until SIGTERM; with ``resume_from`` (a checkpoint), continue its dataset state."""
    from asyncrl.generation.tasks import work_item_factory

    store = build_store(config, work_item_factory(config))
    if resume_from is not None:
        restore_from(store, resume_from)
    if store.evaluation.enabled:
        log.info(
            "eval rounds: %d held-out prompts x %d samples, every %d steps",
            len(store.evaluation.items),
            config.eval.samples_per_prompt,
            config.eval.every_steps,
        )
    endpoint = tcp(config.cluster.bind_address, config.cluster.buffer_port)
    service = BufferService(config, store, endpoint, run_dir)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stopping.set)
        await service.serve_loop()

    uvloop.run(main())
