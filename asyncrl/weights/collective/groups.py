"""The collective weight path's groups: who may join, and how one pairwise group is made.

Learner rank 0 hosts a ``TCPStore`` at ``weights.group_port`` on the run's bind
address (127.0.0.1 unless ``cluster.bind`` says otherwise; the listening
socket is ours, so torch's store does not listen on every interface). A replica
that wants the collective path pushes a signed :class:`JoinRequest` onto the
store's join queue; the learner checks it and answers with a signed
:class:`Accept` naming a fresh group ticket, then both build a
``ProcessGroupGloo`` (``ProcessGroupNCCL`` on CUDA) directly over a
``PrefixStore`` of that ticket: the learner as rank 0, the replica's engine
workers as ranks 1.. (world size 2 for one worker). No global
``init_process_group``: the learner's own FSDP group is never touched.

Why one group per replica, not one for all: a replica joins, leaves or comes
back (elastic join, a restart) by making a group of its own with a fresh
prefix, without re-forming anyone else's; a replica that stalls mid-broadcast
(SIGSTOP, a slow engine) times out its own group only, which is destroyed, and
the others go on; and a gloo/NCCL group that timed out is not reusable anyway.
The price: the learner sends a version once per replica, not once in all.

Who may join. The store has no authentication, so every message through it is
signed, and each side with a key of its own (:func:`group_key`,
:mod:`asyncrl.core.signing`): a replica's join and asks with the generators' key,
the learner's accepts and offers with the learner's, which no generator holds.
A process without the generators' credentials cannot join or ask; a generator
cannot answer as the learner: seat itself as a replica's rank 0, or offer it a
version (docs/security.md). Anyone who can reach the
store's port still can: read what passes through the store (names, shapes, versions),
delete or flood keys (the joins and asks then time out: the replicas fall back
to ZeroMQ), and race the gloo rendezvous of a group being made, so as to sit
in a member's place: read that version's bytes, or feed a replica forged
bucket bytes (never a forged header: names, shapes and the version are
checked). Bucket bytes carry no MAC: hashing every byte would cost more than
the transfer.
"""

from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from asyncrl.core.credentials import GENERATOR, LEARNER, SecurityError, held
from asyncrl.core.keys_folder import stored_group_key
from asyncrl.core.signing import GroupKey

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig

JOIN_QUEUE = "asyncrl/joins"
"""The store queue join requests are pushed onto."""
JOIN_TIMEOUT_S = 30.0
"""How long a join may take, handshake and group rendezvous together."""
MAX_MEMBERS = 64
"""Groups the learner keeps at once; a new join past it drops the longest idle one."""
MAX_WORLD_SIZE = 65
"""The learner plus at most 64 engine workers (tensor parallelism) in one group."""


class GroupAddress(NamedTuple):
    """Where the learner's group store listens."""

    host: str
    port: int


def group_prefix(ticket: int) -> str:
    """The store keys of group ``ticket``: fresh for every join, never reused in a run."""
    return f"asyncrl/group/{ticket}/"


def ask_key(ticket: int, ask: int) -> str:
    return f"{group_prefix(ticket)}ask/{ask}"


def reply_key(ticket: int, ask: int) -> str:
    return f"{group_prefix(ticket)}reply/{ask}"


def accept_key(nonce: str) -> str:
    return f"asyncrl/accept/{nonce}"


def group_key(cluster: ClusterConfig, side: str = GENERATOR) -> GroupKey | None:
    """``side``'s keys on the group (``learner``: rank 0's; ``generator``: a replica's);
    None when ``cluster.auth`` is off.

    What this process was handed (:func:`~asyncrl.core.credentials.held`); a replica
    started by hand derives its own from the keys folder, and reads the
    learner's public key there (``group.key``). Raises SecurityError when it
    cannot: the learner's signing key is only ever handed.
    """
    if not cluster.auth:
        return None
    other = LEARNER if side == GENERATOR else GENERATOR
    credentials = held(cluster)
    if credentials is not None and side in credentials.group_seeds:
        seed, peer = credentials.group_seeds[side], credentials.group_publics.get(other)
        if peer is not None:
            return GroupKey(bytes.fromhex(seed), bytes.fromhex(peer))
    if side == LEARNER:
        raise SecurityError(
            "weights.transport=collective: the learner's group key is handed to the learner "
            "process by `asyncrl launch`, and this process was handed none"
        )
    if not cluster.keys_dir:
        raise SecurityError("weights.transport=collective needs cluster.keys_dir (the run's keys)")
    return stored_group_key(cluster)


def serve_store(host: str, port: int, timeout_s: float = JOIN_TIMEOUT_S) -> dist.TCPStore:
    """The learner's store, listening on ``host`` only (port 0: a free one, ``store.port``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen(128)
    store = dist.TCPStore(
        host,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),  # the store owns (and closes) the socket now
        use_libuv=True,
    )
    return store


def connect_store(address: GroupAddress, timeout_s: float) -> dist.TCPStore:
    """A client of the learner's store (raises when it cannot be reached in ``timeout_s``)."""
    return dist.TCPStore(
        address.host,
        address.port,
        is_master=False,
        timeout=datetime.timedelta(seconds=max(timeout_s, 0.1)),
    )


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host``: where its gloo pairs listen."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return host if host != "localhost" else "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))  # no packet is sent: it only picks the route
        return probe.getsockname()[0]


def make_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device,
    hostname: str,
) -> dist.ProcessGroup:
    """Group ``store`` (a PrefixStore) of ``world_size`` ranks: NCCL for a CUDA ``device``,
    gloo otherwise, its pairs listening on ``hostname``. Blocks until every rank is in,
    at most ``timeout_s``; each collective's own limit is given per call."""
    timeout = datetime.timedelta(seconds=max(timeout_s, 0.1))
    if device.type == "cuda":  # the same code on GPUs; never run on this CPU machine
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = timeout
    options._threads = 1
    return dist.ProcessGroupGloo(store, rank, world_size, options)  # connects every pair


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast ``tensor`` from rank 0, raising when it takes over ``timeout_s`` (gloo
    cancels the send or receive at that limit; the group is then unusable)."""
    finish(post_broadcast(group, tensor, timeout_s), timeout_s)


def post_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> dist.Work:
    """Start a broadcast of ``tensor`` from rank 0 (limited to ``timeout_s``); the group
    runs its broadcasts in the order posted. A receiver posts all of a version's at once,
    so no bucket waits for the receiver's thread to come back for it."""
    if timeout_s <= 0:
        raise TimeoutError("the deadline passed before the broadcast began")
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = datetime.timedelta(seconds=timeout_s)
    return group.broadcast([tensor], options)


def finish(work: dist.Work, timeout_s: float) -> None:
    """Wait for a posted broadcast, raising when it is not done within ``timeout_s``."""
    if timeout_s <= 0 or not work.wait(datetime.timedelta(seconds=timeout_s)):
        raise TimeoutError(f"broadcast not done within {max(timeout_s, 0):.1f}s")


def is_timeout(error: BaseException) -> bool:
    """A gloo/NCCL error that says the operation ran out of time."""
    text = str(error).lower()  # gloo: "Timed out waiting ...", "Operation timed out!"
    return isinstance(error, TimeoutError) or "timed out" in text or "timeout" in text
