"""Versioned weights from the learner to the generators, by three paths.

The learner publishes each ``sync_interval``-th version with
:meth:`WeightPublisher.publish`, which copies the tensors into a host snapshot
(the learner's only stall) and serves them from a thread; each generator's
:class:`WeightClient` pulls the versions newer than the one it holds, chunk by
chunk, and checks every chunk before using it. With ``weights.transport: shm``
the learner writes each version once into a shared-memory segment that replicas on
its host load in place; with ``collective``, learner rank 0 broadcasts the snapshot
into each replica's engine over a pairwise gloo (NCCL on CUDA) group. A replica tries
its configured path first and falls back down the chain to ZeroMQ
(``asyncrl.generators.weight_sync``), each transfer under ``weights.deadline_s``.

One job per module::

    layout.py              dtypes and the chunk layout both ends derive from the tensor index
    snapshot.py            host snapshots: the latest two versions, buffer reuse, recycling
    checks.py              what a replica checks before loading: the engine's layout, finite values
    source.py              WeightSource: one path as a replica sees it; WeightTransferError
    paths.py               which paths a run uses: a replica's chain, the learner's sink
    cuda_ipc.py            CUDA IPC handles for colocated GPUs (written; never run: no GPU here)
    zmq/server.py          WeightPublisher: the ZeroMQ ROUTER thread serving snapshots
    zmq/peers.py           per-peer flow control of chunk requests
    zmq/limits.py          what serving may cost the learner: sizes, queues, heartbeats
    zmq/client.py          WeightClient: fetch with a window, check, restart, rebuild
    zmq/source.py          ZmqSource: the ZeroMQ pull as a path, under a deadline
    shm/segment.py         the shared-memory segment: layout, name, checks
    shm/writer.py          ShmWriter: each version written once into the segment
    shm/reader.py          ShmSource: a replica loads the newest complete slot in place
    shm/publisher.py       ShmPublisher: the learner's sink, shm first, zmq copied on demand
    collective/groups.py   the weight-update groups: store, pairwise gloo/NCCL group, timeouts
    collective/buckets.py  buckets, signed offers and asks, and the checks of an offer
    collective/sender.py   CollectiveSender: learner rank 0 broadcasts to each member
    collective/receiver.py CollectiveSource: a replica joins and receives into staging

``layout`` and ``snapshot`` know nothing of ZeroMQ: another path (shared memory
on one host, a collective across GPUs) serves the same snapshots from a module
of its own beside ``zmq/server.py``.
"""

from asyncrl.weights.layout import DEFAULT_CHUNK_BYTES, TORCH_DTYPES, chunk_pieces
from asyncrl.weights.source import Loaded, PathUnavailable, WeightSource, WeightTransferError
from asyncrl.weights.zmq.client import SLOW_REPLY_MS, WeightClient
from asyncrl.weights.zmq.limits import MAX_WINDOW, PEER_MAX_CHUNKS
from asyncrl.weights.zmq.server import WeightPublisher

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_WINDOW",
    "PEER_MAX_CHUNKS",
    "SLOW_REPLY_MS",
    "TORCH_DTYPES",
    "Loaded",
    "PathUnavailable",
    "WeightClient",
    "WeightPublisher",
    "WeightSource",
    "WeightTransferError",
    "chunk_pieces",
]
