"""A replica's side of the collective path: :class:`CollectiveSource`, one of its weight sources.

At its first sync the source joins the learner's weight-update groups
(:mod:`asyncrl.weights.collective.groups`); then each sync asks the learner, through
the group's store, for a version newer than the one held, checks the signed
:class:`Offer` against the engine's tensors, and receives the buckets:

- an engine that holds its tensors in buckets (``backend.weight_buffers``, the
  HF backend: the policy is a module in this process): straight into its
  tensors, which it moved into one flat buffer per bucket at the first sync,
  so nothing is copied after the transfer. A transfer that fails midway
  leaves a mix: ``WeightTransferError(partial=True)``, and the chain reloads
  a whole version by the next path before a token is generated;
- any other in-process engine: into staging buckets kept from one sync to the
  next, then one ``backend.load_weights`` of views into them. A transfer that
  fails leaves the old weights untouched;
- an engine that loads in place (``backend.in_place_weights``, vLLM's workers:
  ``generators/vllm_weight_sync.py``): the engine's workers are the group's
  ranks 1.. and load each bucket as it arrives. A transfer that fails there
  leaves a partial load, said with ``WeightTransferError(partial=True)``.

After the buckets comes the verdict: a version the learner rewrote while it
was sent (``collective/outgoing.py``) is refused, ``overwritten``, and read
whole from shared memory, the next path; the group stays.

Nothing received counts unchecked (:mod:`~asyncrl.weights.checks`; the broadcast sends from the
shared-memory slot, which any process of the run's user may write): the offer's
names, shapes and dtypes must be the engine's before a byte is received, and
every value received finite before the version counts (a vLLM worker checks
each bucket before the reload gets it). A version refused in staging leaves the
engine as it was; one refused in the engine's own tensors leaves a mix
(``partial``) that the next path replaces with a whole version. Either way it
is counted, and asked for from then on as if held, so it is not sent again.

Any other failure (the deadline, a closed group, a refused offer) destroys the
group and raises :class:`WeightTransferError`: the chain falls back to the
next path, and the next sync joins again with a new group. A replica that
cannot join (no learner store yet) tries again after ``rejoin_after_s``,
using the other paths meanwhile.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import secrets
import time
from collections import Counter
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from asyncrl.core.security import SecurityError
from asyncrl.weights.checks import (
    LAYOUT,
    EngineLayout,
    Refusals,
    WeightsRefused,
    check_finite,
)
from asyncrl.weights.collective.buckets import (
    VERDICT_INTACT,
    Accept,
    Ask,
    Bucket,
    JoinRequest,
    Offer,
    UpToDate,
    check_offer,
    piece_ranges,
    seal,
    unseal,
)
from asyncrl.weights.collective.groups import (
    JOIN_QUEUE,
    JOIN_TIMEOUT_S,
    GroupAddress,
    accept_key,
    ask_key,
    connect_store,
    finish,
    group_key,
    group_prefix,
    is_timeout,
    local_address_towards,
    make_group,
    post_broadcast,
    reply_key,
)
from asyncrl.weights.layout import FROM_NAME
from asyncrl.weights.source import Loaded, PathUnavailable, WeightTransferError

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.core.signing import GroupKey

log = logging.getLogger("asyncrl.weights")

CONNECT_TIMEOUT_S = 5.0
"""How long a join waits to reach the learner's store before falling back."""
REJOIN_AFTER_S = 30.0


class InPlaceEngine(Protocol):
    """An engine whose workers join the group and load the buckets themselves."""

    world_size: int
    """Ranks the engine adds to a group (its workers)."""
    device: str
    """Where its workers hold the weights: ``cuda`` (an NCCL group) or ``cpu`` (gloo)."""

    def join_weight_group(
        self, address: GroupAddress, prefix: str, world_size: int, timeout_s: float
    ) -> None:
        """Make every worker rank ``1 + its rank`` of the group at ``prefix``."""
        ...

    def receive_in_place(self, offer: Offer, timeout_s: float) -> None:
        """Receive ``offer``'s buckets into the running model and make its version current;
        WeightTransferError (``partial=True`` once a bucket reached the model) on failure."""
        ...

    def leave_weight_group(self) -> None: ...


class CollectiveSource:
    """A replica's collective path: join once, then ask and receive per sync."""

    name = "collective"

    def __init__(
        self,
        address: GroupAddress,
        key: GroupKey | None,
        replica: str,
        *,
        bucket_bytes: int,
        rejoin_after_s: float = REJOIN_AFTER_S,
    ):
        self.address = address
        self.key = key
        self.replica = replica
        self.bucket_bytes = bucket_bytes
        self.rejoin_after_s = rejoin_after_s
        self.store: dist.Store | None = None
        self.ticket: int | None = None
        self.group: dist.ProcessGroup | None = None
        self.engine: InPlaceEngine | None = None
        self.asks = 0
        self.joins = 0
        self._retry_at = 0.0
        self._staging: list[torch.Tensor] = []
        self._layout: list[tuple[str, int]] = []
        self.counters: Counter[str] = Counter()
        self._refusals = Refusals(self.counters)
        self._engine_layout = EngineLayout()
        self._refused_version = -1
        """The newest version refused: asked for as if held, so it is not sent again."""

    def sync_into(self, backend, have_version: int, deadline: float) -> Loaded | None:
        if self.ticket is None:
            self._join(backend, deadline)
        asked = max(have_version, self._refused_version)
        reply = self._ask(asked, deadline)
        if isinstance(reply, UpToDate):
            return None
        if reply.version <= asked:
            self._leave()
            raise WeightTransferError(f"collective: offered v{reply.version} for v{asked}")
        layout = self._engine_layout.of(backend)
        specs, optional = (None, set()) if layout is None else (layout.specs, layout.optional)
        try:
            check_offer(reply, asked, specs, set(optional), self.bucket_bytes)
        except WeightTransferError as error:
            self._leave()  # the learner's broadcast to us then fails at once
            refused = WeightsRefused(str(error), reason=LAYOUT)
            self._note(reply.version, refused)
            raise refused from None
        started = time.monotonic()
        if self.engine is not None:
            try:
                self.engine.receive_in_place(reply, deadline - started)
            except WeightsRefused as error:  # the buckets all came: the group is sound
                self._note(reply.version, error)
                raise
            except WeightTransferError as error:
                if not error.overwritten:
                    self._leave()
                error.deadline_missed = error.deadline_missed or time.monotonic() >= deadline
                raise
        elif (homes := self._engine_buffers(backend, reply)) is not None:
            self._receive(reply, homes, deadline, into_engine=True)
            self._check(reply, homes, into_engine=True)
            backend.weights_written(reply.version)
        else:
            self._receive(reply, self._staging_for(reply), deadline, into_engine=False)
            self._check(reply, self._staging, into_engine=False)
            state_dict = bucket_views(reply, self._staging)
            try:
                backend.load_weights(state_dict, reply.version)
            except ValueError as error:  # checked before any weight changed
                raise WeightTransferError(f"collective: v{reply.version}: {error}") from error
            except Exception as error:
                raise WeightTransferError(
                    f"collective: loading v{reply.version} failed: {error}", partial=True
                ) from error
        return Loaded(reply.version, reply.published_at, self.name, time.monotonic() - started)

    # ------------------------------------------------------------------ group

    def _join(self, backend, deadline: float) -> None:
        now = time.monotonic()
        if now < self._retry_at:
            raise PathUnavailable(
                f"collective: not in a group; joining again in {self._retry_at - now:.0f}s"
            )
        self.engine = getattr(backend, "in_place_weights", None)
        world_size = 1 + (self.engine.world_size if self.engine is not None else 1)
        nonce = secrets.token_hex(16)
        try:
            timeout_s = min(JOIN_TIMEOUT_S, deadline - now)
            self.store = connect_store(self.address, min(CONNECT_TIMEOUT_S, timeout_s))
            self.store.set_timeout(datetime.timedelta(seconds=max(timeout_s, 0.1)))
            device = self.engine.device if self.engine is not None else "cpu"
            request = JoinRequest(self.replica, nonce, world_size, device)
            self.store.queue_push(JOIN_QUEUE, seal(request, self.key, "join"))
            self.store.wait([accept_key(nonce)])
            data = self.store.get(accept_key(nonce))
            accept = unseal(data, self.key, f"accept:{nonce}", Accept)
            if accept.nonce != nonce or accept.world_size != world_size:
                raise WeightTransferError("collective: the learner accepted another request")
            prefix = group_prefix(accept.ticket)
            remaining = deadline - time.monotonic()
            if self.engine is not None:
                self.engine.join_weight_group(self.address, prefix, world_size, remaining)
            else:
                prefixed = dist.PrefixStore(prefix, self.store)
                hostname = local_address_towards(self.address.host)
                self.group = make_group(
                    prefixed, 1, world_size, remaining, torch.device("cpu"), hostname
                )
        except Exception as error:
            self._leave()
            self._retry_at = time.monotonic() + self.rejoin_after_s
            raise PathUnavailable(
                f"collective: could not join the learner's group at {self.address.host}:"
                f"{self.address.port} (trying again in {self.rejoin_after_s:.0f}s): {error}"
            ) from error
        self.ticket, self.asks = accept.ticket, 0
        self.joins += 1

    def _ask(self, have_version: int, deadline: float) -> Offer | UpToDate:
        assert self.store is not None and self.ticket is not None
        ask, self.asks = self.asks, self.asks + 1
        try:
            self.store.set(
                ask_key(self.ticket, ask),
                seal(Ask(have_version), self.key, f"ask:{self.ticket}:{ask}"),
            )
            key = reply_key(self.ticket, ask)
            self.store.wait([key], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0)))
            data = self.store.get(key)
            self.store.delete_key(key)
            return unseal(data, self.key, f"reply:{self.ticket}:{ask}", Offer | UpToDate)
        except Exception as error:
            self._leave()
            if isinstance(error, WeightTransferError):
                raise
            raise WeightTransferError(
                f"collective: no answer from the learner: {error}",
                deadline_missed=time.monotonic() >= deadline,
            ) from error

    @staticmethod
    def _engine_buffers(backend, offer: Offer) -> list[torch.Tensor] | None:
        """The engine's own tensors as the offer's buckets, where it can hold them so."""
        weight_buffers = getattr(backend, "weight_buffers", None)
        return None if weight_buffers is None else weight_buffers(offer.buckets)

    def _staging_for(self, offer: Offer) -> list[torch.Tensor]:
        """Staging buckets for the offer, kept from one sync to the next."""
        layout = [(bucket.dtype, bucket.nbytes) for bucket in offer.buckets]
        if layout != self._layout:
            self._staging = [torch.empty(n, dtype=torch.uint8) for _, n in layout]
            self._layout = layout
        return self._staging

    def _receive(
        self, offer: Offer, flats: list[torch.Tensor], deadline: float, *, into_engine: bool
    ) -> None:
        """The offer's buckets into ``flats``, then the verdict; ``into_engine``: the flats
        are the engine's tensors, so any failure leaves a mix (``partial``)."""
        verdict = torch.zeros(1, dtype=torch.int64)
        try:
            remaining = deadline - time.monotonic()
            pairs = zip(offer.buckets, flats, strict=True)
            received = [flat[a:b] for bucket, flat in pairs for a, b in piece_ranges(bucket)]
            received.append(verdict)
            works = [post_broadcast(self.group, flat, remaining) for flat in received]
            for work in works:
                finish(work, deadline - time.monotonic())
        except Exception as error:
            self._leave()
            raise WeightTransferError(
                f"collective: receiving v{offer.version} failed: {error}",
                partial=into_engine,
                deadline_missed=is_timeout(error) or time.monotonic() >= deadline,
            ) from error
        if int(verdict.item()) != VERDICT_INTACT:
            raise overwritten(offer.version, partial=into_engine)

    def _check(self, offer: Offer, flats: list[torch.Tensor], *, into_engine: bool) -> None:
        """Refuse the received version when a value is not finite; ``into_engine``: the
        flats are the engine's tensors, which now hold it (``partial``)."""
        views = bucket_views(offer, flats)
        try:
            check_finite(views.items(), offer.version, self.name, partial=into_engine)
        except WeightsRefused as error:
            self._note(offer.version, error)
            raise

    def _note(self, version: int, error: WeightsRefused) -> None:
        self._refusals.note(version, error)
        self._refused_version = max(self._refused_version, version)

    def _leave(self) -> None:
        """Destroy the group (a timed-out group is not reusable); the next sync re-joins."""
        if self.engine is not None and self.ticket is not None:
            # an engine that failed may not answer; its group goes with it
            with contextlib.suppress(Exception):
                self.engine.leave_weight_group()
        self.group = None
        self.ticket = None
        self.store = None

    def close(self) -> None:
        self._leave()


def overwritten(version: int, *, partial: bool) -> WeightTransferError:
    """The learner rewrote the slot while v``version`` was sent: the group is fine, the
    bytes are not; the next path (shared memory) reads the version whole."""
    return WeightTransferError(
        f"collective: v{version} was rewritten while it was sent", partial=partial, overwritten=True
    )


def bucket_views(offer: Offer, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of ``offer`` as a view into its received bucket (no copy)."""
    views = {}
    for bucket, flat in zip(offer.buckets, buckets, strict=True):
        views.update(tensor_views(bucket, flat))
    return views


def tensor_views(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of one received ``bucket`` (bytes ``flat``) as views, in bucket order."""
    dtype = FROM_NAME[bucket.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    views = {}
    for tensor in bucket.tensors:
        count = 1
        for size in tensor.shape:
            count *= size
        piece = flat[tensor.offset : tensor.offset + count * itemsize]
        views[tensor.name] = piece.view(dtype).reshape(tensor.shape)
    return views


def replica_source(config: Config, replica: str, host: str) -> CollectiveSource | None:
    """The collective source of replica ``replica`` when ``weights.transport`` is
    ``collective`` and the group can be found (``host``: the learner's, as this replica
    reaches it); else None, and the chain starts at the next path."""
    weights = config.weights
    if weights.transport != "collective":
        return None
    if not weights.group_port:
        log.warning("%s: weights.group_port is 0, so the learner's group cannot be found", replica)
        return None
    try:
        key = group_key(config.cluster)
    except SecurityError as error:
        log.warning("%s: no collective weight path: %s", replica, error)
        return None
    address = GroupAddress(host, weights.group_port)
    return CollectiveSource(address, key, replica, bucket_bytes=weights.bucket_bytes)
