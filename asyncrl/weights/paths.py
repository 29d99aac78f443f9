"""Which weight-sync paths a run uses, from ``weights.transport``, on both ends.

The paths, fastest first: ``collective`` -> ``shm`` -> ``zmq``. A replica's
chain starts at the configured one and keeps every path below it, ending at
zmq, the path that always works (across machines, for late joiners). The
learner's rank 0 serves every path of the chain: with ``shm`` or
``collective`` configured it also writes the shared-memory segment, so that a
replica on its host whose broadcast fails falls back to memory, not to the
network. ``shm`` is the default: replicas on the learner's host read shared
memory, the others find no segment there and use zmq. With ``zmq`` alone: one
:class:`~asyncrl.weights.WeightPublisher`, one ZeroMQ client per replica.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.core.weight_messages import WEIGHT_PATHS
from asyncrl.weights.shm.publisher import ShmPublisher
from asyncrl.weights.shm.reader import ShmSource
from asyncrl.weights.shm.writer import ShmWriter, remove_leftover
from asyncrl.weights.source import WeightSource
from asyncrl.weights.zmq.server import WeightPublisher

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.weights.collective.sender import WithBroadcast


def chain_paths(transport: str) -> tuple[str, ...]:
    """The configured path and every one below it: ``shm`` -> ``("shm", "zmq")``."""
    return WEIGHT_PATHS[WEIGHT_PATHS.index(transport) :]


def replica_sources(
    config: Config,
    run_dir: Path | None,
    zmq: WeightSource,
    collective: WeightSource | None = None,
) -> list[WeightSource]:
    """A replica's chain: ``collective`` (when configured and built by the caller, which
    knows the engine), ``shm`` (the segment the learner of ``run_dir`` names), ``zmq``."""
    built: dict[str, WeightSource | None] = {
        "collective": collective,
        "shm": ShmSource(run_dir),
        "zmq": zmq,
    }
    paths = chain_paths(config.weights.transport)
    return [source for path in paths if (source := built[path]) is not None]


def learner_sink(
    config: Config, run_dir: Path, zmq: WeightPublisher
) -> WeightPublisher | ShmPublisher | WithBroadcast:
    """Rank 0's sink for the shm and zmq paths: ``zmq`` alone when configured, else shared
    memory first and ``zmq`` fed from it (:mod:`.shm.publisher`); with ``collective`` also
    the broadcast beside it (:class:`~.collective.sender.WithBroadcast`), sending from the
    segment (or the snapshots ``zmq`` holds)."""
    if config.weights.transport == "zmq":
        remove_leftover(run_dir)  # of an earlier shm run of this run dir that crashed
        return zmq
    sink = ShmPublisher(zmq, ShmWriter(run_dir))
    if config.weights.transport == "collective":  # the broadcast sends the slot beside it
        from asyncrl.weights.collective.sender import WithBroadcast, learner_sender

        return WithBroadcast(sink, learner_sender(config, zmq.snapshots, run_dir))
    return sink
