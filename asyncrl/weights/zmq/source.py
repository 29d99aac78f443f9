"""The ZeroMQ pull as a weight-sync path: :class:`WeightClient` behind the source interface.

The path across machines and the last fallback of every chain. The deadline
maps onto the client's reply timeouts: no reply is waited for past it
(``WeightClient.deadline``), so a silent learner costs at most the deadline, and
a fetch that times out drops its socket, which cancels the chunk requests still
in flight. Any error of the fetch (a timeout, a chunk that fails its checks)
becomes :class:`~asyncrl.weights.source.WeightTransferError`; nothing reaches
the engine until the whole version has arrived and passed its checks.

What the learner serves may have been copied from the shared-memory slot, which
any process of the run's user may write, so the version is checked like every
other path's (:mod:`~asyncrl.weights.checks`): its manifest's layout against the engine's before
a chunk is asked for, every value finite once fetched, both before the engine
gets a byte. A refused version (by its number and publish time) is neither
fetched nor counted again.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Protocol

import torch

from asyncrl.weights.checks import (
    EngineLayout,
    Refusals,
    WeightsRefused,
    check_finite,
    check_layout,
)
from asyncrl.weights.source import Loaded, WeightTransferError

if TYPE_CHECKING:
    from asyncrl.core.messages import WeightsManifest
    from asyncrl.generators.backend import Backend

DEADLINE_SLACK_S = 0.005
"""A timeout this close to the deadline is the deadline's (poll timeouts are whole ms)."""


class Fetcher(Protocol):
    """What :class:`ZmqSource` needs of a client: :class:`~asyncrl.weights.WeightClient`."""

    def fetch_newer(
        self, have_version: int
    ) -> tuple[int, float, dict[str, torch.Tensor]] | None: ...


class ZmqSource:
    """The ZeroMQ pull as a :class:`~asyncrl.weights.source.WeightSource`."""

    name = "zmq"

    def __init__(self, client: Fetcher):
        self.client = client
        self.counters: Counter[str] = Counter()
        self._refusals = Refusals(self.counters)
        self._engine_layout = EngineLayout()

    def sync_into(self, backend: Backend, have_version: int, deadline: float) -> Loaded | None:
        layout = self._engine_layout.of(backend)

        def screen(manifest: WeightsManifest) -> bool:
            """Fetch a version only if not refused already and laid out as the engine is."""
            publish = (manifest.version, manifest.published_at)
            if publish in self._refusals:
                return False
            try:
                check_layout(layout, manifest.tensors, manifest.version, self.name)
            except WeightsRefused as error:
                self._refusals.note(publish, error)
                raise
            return True

        self.client.deadline = deadline  # type: ignore[attr-defined]  (plain fakes take it too)
        self.client.screen = screen  # type: ignore[attr-defined]
        try:
            update = self.client.fetch_newer(have_version)
        except WeightsRefused:
            raise
        except TimeoutError as error:
            missed = time.monotonic() >= deadline - DEADLINE_SLACK_S  # polls end on a ms
            raise WeightTransferError(f"zmq: {error}", deadline_missed=missed) from error
        except Exception as error:  # a chunk that failed its checks, a socket error
            raise WeightTransferError(f"zmq: {error}") from error
        finally:
            self.client.deadline = None  # type: ignore[attr-defined]
            self.client.screen = None  # type: ignore[attr-defined]
        if update is None:
            return None
        version, published_at, state_dict = update
        try:
            check_finite(state_dict.items(), version, self.name)
        except WeightsRefused as error:
            self._refusals.note((version, published_at), error)
            raise
        started = time.perf_counter()
        try:
            backend.load_weights(state_dict, version)
        except ValueError as error:  # refused before any weight changed (the contract)
            raise WeightTransferError(f"zmq v{version}: {error}") from error
        except Exception as error:
            raise WeightTransferError(
                f"zmq v{version}: loading failed: {error!r}", partial=True
            ) from error
        return Loaded(version, published_at, self.name, time.perf_counter() - started)

    def close(self) -> None:
        close = getattr(self.client, "close", None)
        if close is not None:
            close()
