"""The trained weights, handed to the generators every ``learner.sync_interval`` versions.

Gathering the full tensors is a collective: every rank runs the same
:class:`Publisher` at the same versions. Rank 0 streams them into the
:class:`~asyncrl.weights.WeightPublisher` (one parameter gathered, copied and
released at a time); the other ranks only take part in the gathers
(:class:`Drain`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from asyncrl.config import Config
from asyncrl.core import progress
from asyncrl.generation import lora
from asyncrl.learner.policy import Learner

log = logging.getLogger("asyncrl.learner")


class WeightSink(Protocol):
    """Where a rank's gathered tensors go: :class:`~asyncrl.weights.WeightPublisher` on
    rank 0, :class:`Drain` on the others."""

    def publish(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> object: ...

    def stats(self) -> dict[str, float]: ...


class Drain:
    """The sink of every rank but 0: takes part in the gathers; rank 0 keeps the tensors."""

    def publish(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        for _ in tensors:
            pass

    def stats(self) -> dict[str, float]:
        return {}


Announce = Callable[[int, str], bool]
"""Tells the buffer a version's adapter digest before any replica can fetch the version;
False when a stop cut it short (the version is then not published)."""


class Publisher:
    """Publishes the policy when its version is due, and once more at the end when the
    final policy's eval (``eval.at_end``) needs weights the generators do not have yet.

    With adapters published alone, the version's adapter digest is announced (``announce``,
    rank 0's line to the buffer) before the sink serves it, so the buffer knows what every
    sample of the version must have been generated with before the first one arrives."""

    def __init__(
        self, learner: Learner, config: Config, sink: WeightSink, announce: Announce | None = None
    ):
        self.learner = learner
        self.sink = sink
        self.announce = announce
        self.sync_interval = config.learner.sync_interval
        self.publish_at_end = config.eval.enabled and config.eval.at_end
        self.published: int | None = None
        """The version the generators were last handed."""

    def publish(self) -> float:
        """Hand the current weights to the generators; returns the seconds training stalled."""
        version = self.learner.version
        progress.beat(f"publishing weights v{version}")
        started = time.perf_counter()
        tensors = self.learner.published_tensors()
        if self.learner.publishes_adapters:  # megabytes: held whole to be digested first
            tensors = list(tensors)
            if self.announce is not None and not self.announce(
                version, lora.adapter_digest(tensors)
            ):
                log.info("v%d not published: stopping before the buffer took its digest", version)
                return time.perf_counter() - started
        self.sink.publish(tensors, version)
        self.published = version
        return time.perf_counter() - started

    def after_step(self) -> float:
        """Publish if this version is due (every ``learner.sync_interval``); the stall."""
        if self.learner.version % self.sync_interval:
            return 0.0
        return self.publish()

    def finish(self) -> None:
        """After the last step: the final eval evaluates published weights, so publish the
        final version if it is not yet (and the final eval will run)."""
        if self.publish_at_end and self.published != self.learner.version:
            self.publish()

    def stats(self) -> dict[str, float]:
        """The publisher's ``weights_*`` counters (rank 0's; empty on the others)."""
        return self.sink.stats()
