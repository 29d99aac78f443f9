"""Learner rank 0's side of the collective path: admit members, broadcast what they ask for.

:class:`CollectiveSender` sends what the learner's publish already wrote: the
shared-memory slot, followed while it is written, or else the ZeroMQ
publisher's snapshot (:mod:`.outgoing`). Nothing is added to the
learner's publish, the only stall. A thread admits join requests
(:mod:`asyncrl.weights.collective.groups`); each member then has a thread of its own
that waits for the member's signed :class:`Ask`, answers with the newest
version's :class:`Offer` (or :class:`UpToDate`), broadcasts its buckets, and
then the verdict: whether the slot still held that version once all was sent.

Each broadcast has what is left of ``deadline_s`` as its gloo timeout. A
member that misses it (a stopped or stalled replica) is cancelled there:
counted (``weights_collective_deadline_missed_total``), logged with the
replica and the version, and its group destroyed; the replica re-joins with a
new group. The other members, and the learner, never wait for it.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from asyncrl.weights.collective.buckets import (
    VERDICT_INTACT,
    Accept,
    Ask,
    JoinRequest,
    Offer,
    UpToDate,
    piece_ranges,
    seal,
    unseal,
)
from asyncrl.weights.collective.groups import (
    JOIN_QUEUE,
    JOIN_TIMEOUT_S,
    MAX_MEMBERS,
    MAX_WORLD_SIZE,
    GroupAddress,
    accept_key,
    ask_key,
    broadcast,
    connect_store,
    group_prefix,
    is_timeout,
    make_group,
    reply_key,
    serve_store,
)
from asyncrl.weights.collective.outgoing import SlotVersion, newest_in_slots, newest_in_snapshots
from asyncrl.weights.shm.reader import ShmSource
from asyncrl.weights.snapshot import SnapshotStore
from asyncrl.weights.source import WeightTransferError

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.core.signing import GroupKey

log = logging.getLogger("asyncrl.weights")

IDLE_WAIT_S = 3600.0
"""How long a member's thread waits for an ask in one go (stopping it sets the key)."""
NONCE_HEX = 32


class CollectiveSender:
    """Admits replicas into pairwise groups and broadcasts snapshots to them on request."""

    def __init__(
        self,
        snapshots: SnapshotStore,
        host: str,
        port: int,
        key: GroupKey | None,
        *,
        bucket_bytes: int,
        deadline_s: float,
        device: torch.device | None = None,
        run_dir: Path | None = None,
    ):
        """Serve at ``host:port`` (0: a free port, then ``address.port``) the shared-memory
        segment the learner of ``run_dir`` writes, and ``snapshots`` where it has nothing
        newer (``run_dir`` None: only ``snapshots``); ``key``, the learner's side of the
        group, signs what it says and checks what replicas say (None: ``cluster.auth``
        off, anyone may join)."""
        self.snapshots = snapshots
        self.run_dir = run_dir
        self.key = key
        self.bucket_bytes = bucket_bytes
        self.deadline_s = deadline_s
        self.device = device or torch.device("cpu")
        self.store = serve_store(host, port)
        self.address = GroupAddress(host, self.store.port)
        self.counters: Counter[str] = Counter()
        self.members: dict[str, _Member] = {}
        self._lock = threading.Lock()
        self._nonces: set[str] = set()
        self._tickets = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._admit_loop, name="weights-group", daemon=True)
        self._thread.start()

    def count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self.counters[name] += by

    # ------------------------------------------------------------------ admission

    def _admit_loop(self) -> None:
        client = connect_store(self.address, JOIN_TIMEOUT_S)
        while not self._stop.is_set():
            try:
                data = client.queue_pop(JOIN_QUEUE, False)
            except dist.QueueEmptyError:
                self._stop.wait(0.05)
                continue
            except Exception:  # the store is closing
                if not self._stop.is_set():
                    log.exception("collective: the join queue failed")
                return
            try:
                self._admit(data)
            except Exception:
                self.count("joins_refused")
                log.exception("collective: a join request could not be answered")

    def _admit(self, data: bytes) -> None:
        try:
            request = unseal(data, self.key, "join", JoinRequest)
        except WeightTransferError as error:
            self.count("joins_refused")
            log.warning("%s", error)
            return
        problem = None
        if not 2 <= request.world_size <= MAX_WORLD_SIZE:
            problem = f"a group of {request.world_size}"
        elif len(request.nonce) != NONCE_HEX or request.nonce in self._nonces:
            problem = "a reused nonce"
        elif not 0 < len(request.replica) <= 200:
            problem = "no replica name"
        elif request.device not in ("cpu", "cuda"):
            problem = f"device {request.device[:20]!r}"
        if problem:
            self.count("joins_refused")
            log.warning("collective: refused a join request (%s)", problem)
            return
        self._nonces.add(request.nonce)
        ticket = next(self._tickets)
        with self._lock:
            old = self.members.pop(request.replica, None)
            if old is None and len(self.members) >= MAX_MEMBERS:
                old = self.members.pop(min(self.members, key=lambda n: self.members[n].active_at))
            member = _Member(self, ticket, request)
            self.members[request.replica] = member
        if old is not None:
            old.stop()  # a restarted replica, or the longest idle one past MAX_MEMBERS
        accept = Accept(ticket, request.nonce, request.world_size)
        self.store.set(accept_key(request.nonce), seal(accept, self.key, f"accept:{request.nonce}"))
        member.start()
        self.count("joins_accepted")

    def drop(self, member: _Member) -> None:
        with self._lock:
            if self.members.get(member.replica) is member:
                del self.members[member.replica]

    # ------------------------------------------------------------------ reporting

    def stats(self) -> dict[str, float]:
        """``weights_collective_<counter>_total`` (joins_accepted, joins_refused,
        transfers_finished, deadline_missed, transfer_failures, bytes_sent, ...) and
        ``weights_collective_members`` (groups alive now)."""
        with self._lock:
            counters = dict(self.counters)
            members = len(self.members)
        stats = {f"weights_collective_{name}_total": float(n) for name, n in counters.items()}
        stats["weights_collective_members"] = float(members)
        return stats

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            members, self.members = list(self.members.values()), {}
        for member in members:
            member.stop()
        for member in members:
            member.join(timeout=5)
        del self.store


class _Member(threading.Thread):
    """One replica's group and the thread that serves it."""

    def __init__(self, sender: CollectiveSender, ticket: int, request: JoinRequest):
        super().__init__(name=f"weights-group-{ticket}", daemon=True)
        self.sender = sender
        self.ticket = ticket
        self.replica = request.replica
        self.world_size = request.world_size
        # NCCL where both ends are on CUDA, gloo otherwise (a CPU replica of a GPU learner)
        on_cuda = request.device == "cuda" and sender.device.type == "cuda"
        self.device = sender.device if on_cuda else torch.device("cpu")
        self.active_at = time.monotonic()
        self.stopped = threading.Event()
        self.next_ask = 0
        self.group: dist.ProcessGroup | None = None
        self.staging: torch.Tensor | None = None
        self.slots = ShmSource(sender.run_dir) if sender.run_dir is not None else None
        """The member's own mapping of the segment (a reader's, read-only)."""

    def stop(self) -> None:
        """End the thread: it waits on its next ask's key, so set that key (to nothing)."""
        self.stopped.set()
        with contextlib.suppress(Exception):  # the store is gone: so is every wait on it
            self.sender.store.set(ask_key(self.ticket, self.next_ask), b"")

    def run(self) -> None:
        sender = self.sender
        try:
            client = connect_store(sender.address, JOIN_TIMEOUT_S)
            prefixed = dist.PrefixStore(group_prefix(self.ticket), client)
            self.group = make_group(
                prefixed, 0, self.world_size, JOIN_TIMEOUT_S, self.device, sender.address.host
            )
        except Exception as error:
            sender.count("joins_failed")
            log.warning("collective: %s did not complete its group: %s", self.replica, error)
            sender.drop(self)
            return
        log.info("collective: %s joined (group %d)", self.replica, self.ticket)
        try:
            self._serve(client)
        finally:
            self.group = None  # destroyed: a member that comes back makes a new one
            if self.slots is not None:
                self.slots.close()
            sender.drop(self)

    def _serve(self, client: dist.Store) -> None:
        sender = self.sender
        for ask in itertools.count():
            self.next_ask = ask
            key = ask_key(self.ticket, ask)
            while not self._arrived(client, key) and not self.stopped.is_set():
                pass
            if self.stopped.is_set():
                return
            data = client.get(key)
            client.delete_key(key)
            context = f"ask:{self.ticket}:{ask}"
            try:
                request = unseal(data, sender.key, context, Ask)
            except WeightTransferError as error:
                sender.count("asks_refused")
                log.warning("collective: %s: %s; its group is dropped", self.replica, error)
                return
            self.active_at = time.monotonic()
            if not self._answer(client, ask, request.have_version):
                return

    def _arrived(self, client: dist.Store, key: str) -> bool:
        try:
            client.wait([key], datetime.timedelta(seconds=IDLE_WAIT_S))
        except Exception:  # not yet (DistStoreError on a timeout), or the store is gone
            return self.stopped.wait(1.0)
        return True

    def _answer(self, client: dist.Store, ask: int, have_version: int) -> bool:
        """Offer and broadcast the newest version; False when the group is done for."""
        sender = self.sender
        context = f"reply:{self.ticket}:{ask}"
        outgoing = None
        if self.slots is not None:
            outgoing = newest_in_slots(self.slots, have_version, sender.bucket_bytes)
        if outgoing is None:
            found = newest_in_snapshots(sender.snapshots, have_version, sender.bucket_bytes)
            if isinstance(found, int):
                client.set(reply_key(self.ticket, ask), seal(UpToDate(found), sender.key, context))
                return True
            outgoing = found
        started = time.monotonic()
        try:
            offer = Offer(outgoing.version, outgoing.published_at, outgoing.buckets)
            client.set(reply_key(self.ticket, ask), seal(offer, sender.key, context))
            deadline = started + sender.deadline_s
            for number, bucket in enumerate(outgoing.buckets):
                for start, end in piece_ranges(bucket):
                    piece = outgoing.piece(number, start, end, deadline, self._stage)
                    broadcast(self.group, self._on_device(piece), deadline - time.monotonic())
                    sender.count("bytes_sent", end - start)
            intact = outgoing.intact(deadline)
            verdict = torch.tensor([VERDICT_INTACT if intact else 0], device=self.device)
            broadcast(self.group, verdict, deadline - time.monotonic())
        except Exception as error:
            sender.drop(self)  # first: whoever reads the count sees the member gone
            missed = is_timeout(error)
            sender.count("deadline_missed" if missed else "transfer_failures")
            log.warning(
                "collective: sending v%d to %s %s after %.1fs (%s); its group is dropped and "
                "it re-joins",
                outgoing.version,
                self.replica,
                "missed the deadline" if missed else "failed",
                time.monotonic() - started,
                str(error)[:200],
            )
            return False
        finally:
            outgoing.release()
        if not intact:  # the replica discards it and reads the slot by the next path
            sender.count("transfers_overwritten")
            log.info("collective: v%d was rewritten while sent to %s", offer.version, self.replica)
            return True
        sender.count("transfers_finished")
        if isinstance(outgoing, SlotVersion):
            sender.count("transfers_followed" if outgoing.following else "transfers_from_slot")
        return True

    def _stage(self, nbytes: int) -> torch.Tensor:
        """The member's staging buffer on its device, grown to ``nbytes`` when needed."""
        if self.staging is None or self.staging.numel() < nbytes:
            size = max(nbytes, min(self.sender.bucket_bytes, 1 << 30))
            self.staging = torch.empty(size, dtype=torch.uint8, device=self.device)
        return self.staging

    def _on_device(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` where the group sends from (a host slot's bytes to the GPU for NCCL)."""
        if flat.device == self.device:
            return flat
        staged = self._stage(flat.numel())[: flat.numel()]
        staged.copy_(flat)
        return staged


class WithBroadcast:
    """Rank 0's sink with the collective path beside it: publishes through ``sink`` (whose
    shared-memory slot, or ZeroMQ snapshot, the broadcast sends), reports and closes both."""

    def __init__(self, sink, sender: CollectiveSender):
        self.sink = sink
        self.sender = sender

    @property
    def version(self) -> int:
        return self.sink.version

    def publish(self, tensors, version: int, **kwargs) -> float:
        return self.sink.publish(tensors, version, **kwargs)

    def stats(self) -> dict[str, float]:
        return {**self.sink.stats(), **self.sender.stats()}

    def close(self) -> None:
        self.sender.close()
        self.sink.close()


def learner_sender(config: Config, snapshots: SnapshotStore, run_dir: Path) -> CollectiveSender:
    """The run's sender on learner rank 0: the group store at ``cluster.bind`` (or
    ``cluster.host``) and ``weights.group_port``, serving the segment of ``run_dir`` and
    ``snapshots``."""
    from asyncrl.weights.collective.groups import group_key

    weights, cluster = config.weights, config.cluster
    if not weights.group_port:
        log.warning(
            "weights.group_port is 0: the group store gets a free port no replica is told "
            "(`asyncrl launch` resolves it); replicas will use the other paths"
        )
    return CollectiveSender(
        snapshots,
        cluster.bind_address,
        weights.group_port,
        group_key(cluster, "learner"),
        bucket_bytes=weights.bucket_bytes,
        deadline_s=weights.deadline_s,
        run_dir=run_dir,
    )
