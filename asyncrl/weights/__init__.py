"""Versioned weights from the learner to the generators, in chunks.

The learner publishes each ``sync_interval``-th version with
:meth:`WeightPublisher.publish`, which copies the tensors into a host snapshot
(the learner's only stall) and serves them from a thread; each generator's
:class:`WeightClient` pulls the versions newer than the one it holds, chunk by
chunk, and checks every chunk before using it.

One job per module::

    layout.py       dtypes and the chunk layout both ends derive from the tensor index
    snapshot.py     host snapshots: the latest two versions, buffer reuse, recycling
    zmq_server.py   WeightPublisher: the ZeroMQ ROUTER thread serving snapshots
    zmq_peers.py    per-peer flow control of chunk requests
    zmq_limits.py   what serving may cost the learner: sizes, queues, heartbeats
    zmq_client.py   WeightClient: fetch with a window, check, restart, rebuild

``layout`` and ``snapshot`` know nothing of ZeroMQ: another path (shared memory
on one host, a collective across GPUs) serves the same snapshots from a module
of its own beside ``zmq_server``.
"""

from asyncrl.weights.layout import DEFAULT_CHUNK_BYTES, TORCH_DTYPES, chunk_pieces
from asyncrl.weights.zmq_client import SLOW_REPLY_MS, WeightClient
from asyncrl.weights.zmq_limits import MAX_WINDOW, PEER_MAX_CHUNKS
from asyncrl.weights.zmq_server import WeightPublisher

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_WINDOW",
    "PEER_MAX_CHUNKS",
    "SLOW_REPLY_MS",
    "TORCH_DTYPES",
    "WeightClient",
    "WeightPublisher",
    "chunk_pieces",
]
