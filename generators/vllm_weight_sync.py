"""vLLM's side of the collective weight path: the engine's workers join the group, load in place.

Every engine is started with :class:`CollectiveWeightExtension` as its
``worker_extension_cls`` (``vllm_backend.WORKER_EXTENSION``; what verl, NeMo-RL
and TRL do too), so every worker gains three methods beside the file and
in-memory loads, called through ``collective_rpc`` on the collective path:

- ``asyncrl_join_group``: the worker connects to the learner's group store and
  becomes rank ``1 + its rank`` of the group the replica was granted
  (:mod:`asyncrl.weights.collective.groups`); gloo on CPU, NCCL on CUDA, by the
  worker's device;
- ``asyncrl_receive``: the worker receives the offer's buckets one by one and
  hands each bucket's tensors to vLLM's in-place reload (``reload_weights``
  with an iterator: layer-wise loading plus the per-layer weight processing,
  e.g. the CPU backend's GEMM repacking) as they arrive. Each bucket is a
  fresh tensor, never a reused one: the reload keeps the loaded tensors of a
  layer until the layer is complete, which may be a bucket later. Then the
  verdict: a version the learner rewrote while it was sent is a partial load;
- ``asyncrl_leave_group``: drop the group (a timed-out group is not reusable).

Each bucket is checked before the reload gets it (:func:`asyncrl.weights.checks.nonfinite`):
a bucket holding a NaN or an infinity is not loaded, nor any after it (they are
received and dropped, so the group stays in step), and the load is refused
(``WeightsRefused``, ``partial`` when an earlier bucket went in).

In place means a transfer that fails midway leaves the layers it reached
loaded with the new version and the rest with the old: the worker stops
feeding the reload (which then restores the untouched layers and finishes),
and reports how far it got. :class:`VLLMInPlace` (what
``VLLMBackend.in_place_weights`` returns) turns that into
``WeightTransferError(partial=True)``, so the replica's chain reloads a whole
version by another path before any token is generated.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from asyncrl.generators.vllm_backend import WeightLoaderExtension
from asyncrl.weights.checks import NONFINITE, WeightsRefused, nonfinite
from asyncrl.weights.collective.buckets import (
    VERDICT_INTACT,
    Offer,
    piece_ranges,
    seal,
    unseal,
)
from asyncrl.weights.collective.groups import (
    GroupAddress,
    broadcast,
    connect_store,
    is_timeout,
    local_address_towards,
    make_group,
)
from asyncrl.weights.collective.receiver import tensor_views
from asyncrl.weights.source import WeightTransferError

if TYPE_CHECKING:
    from asyncrl.generators.vllm_backend import VLLMBackend

_IN_PROCESS = "worker"
"""The signing context of an offer handed to the workers (no key: the generator checked it)."""


class CollectiveWeightExtension(WeightLoaderExtension):
    """Mixed into vLLM's worker class: the collective path's group and in-place loads."""

    def asyncrl_join_group(
        self, host: str, port: int, prefix: str, world_size: int, hostname: str, timeout_s: float
    ) -> int:
        """Join the group at ``prefix`` of the learner's store; returns this worker's rank."""
        store = connect_store(GroupAddress(host, port), timeout_s)
        rank = 1 + int(getattr(self, "rank", 0))
        device = getattr(self, "device", torch.device("cpu"))
        prefixed = dist.PrefixStore(prefix, store)
        self._asyncrl_group = make_group(prefixed, rank, world_size, timeout_s, device, hostname)
        self._asyncrl_store = store
        return rank

    def asyncrl_leave_group(self) -> None:
        self._asyncrl_group = None
        self._asyncrl_store = None

    def asyncrl_receive(self, offer_bytes: bytes, tied: list[str] | None, timeout_s: float) -> dict:
        """Receive the offer's buckets into the running model, then the verdict; how far it
        got, and why not further: ``{"buckets": received, "fed": loaded, "error": "",
        "timed_out": False, "overwritten": False, "refused": ""}`` (``refused``: the first
        bucket's problem that kept it and the rest from the reload)."""
        offer = unseal(offer_bytes, None, _IN_PROCESS, Offer)
        group = getattr(self, "_asyncrl_group", None)
        deadline = time.monotonic() + timeout_s
        device = getattr(self, "device", torch.device("cpu"))
        names = {tensor.name for bucket in offer.buckets for tensor in bucket.tensors}
        head = tied[1] if tied and tied[1] not in names else None
        report = {
            "buckets": 0, "fed": 0, "error": "", "timed_out": False, "overwritten": False,
            "refused": "",
        }  # fmt: skip

        def arriving():
            """Each bucket's tensors as the bucket arrives, once they are all finite; on a
            failure, stop feeding; after a refused bucket, receive the rest unfed (the group
            stays in step with the learner)."""
            try:
                if group is None:
                    raise RuntimeError("this worker is in no weight-update group")
                for bucket in offer.buckets:
                    flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
                    for start, end in piece_ranges(bucket):
                        broadcast(group, flat[start:end], deadline - time.monotonic())
                    report["buckets"] += 1
                    views = tensor_views(bucket, flat)
                    if not report["refused"]:
                        report["refused"] = nonfinite(views.items()) or ""
                    if report["refused"]:
                        continue
                    report["fed"] += 1
                    for name, view in views.items():
                        yield name, view
                        if head is not None and name == tied[0]:
                            yield head, view  # vLLM holds the tied head untied (vllm_backend)
                verdict = torch.zeros(1, dtype=torch.int64, device=device)
                broadcast(group, verdict, deadline - time.monotonic())
                if int(verdict.item()) != VERDICT_INTACT:
                    report["overwritten"] = True
                    raise RuntimeError(f"v{offer.version} was rewritten while it was sent")
            except Exception as error:
                report["error"] = f"{type(error).__name__}: {error}"[:500]
                report["timed_out"] = is_timeout(error)

        try:
            self.reload_weights(weights_iterator=arriving(), is_checkpoint_format=True)
        except Exception as error:  # vLLM refused a tensor: as partial as a broken transfer
            report["error"] = report["error"] or f"{type(error).__name__}: {error}"[:500]
        return report


class VLLMInPlace:
    """The collective source's route into a running vLLM engine's workers."""

    def __init__(self, backend: VLLMBackend):
        self.backend = backend
        config = backend.llm.llm_engine.vllm_config
        self.world_size = int(config.parallel_config.world_size)
        self.device = "cuda" if config.device_config.device_type == "cuda" else "cpu"

    def join_weight_group(
        self, address: GroupAddress, prefix: str, world_size: int, timeout_s: float
    ) -> None:
        hostname = local_address_towards(address.host)
        args = (address.host, address.port, prefix, world_size, hostname, timeout_s)
        self.backend.llm.collective_rpc("asyncrl_join_group", args=args)

    def receive_in_place(self, offer: Offer, timeout_s: float) -> None:
        backend = self.backend
        started = time.perf_counter()
        tied = list(backend.tied) if backend.tied else None
        args = (seal(offer, None, _IN_PROCESS), tied, timeout_s)
        try:
            reports = backend.llm.collective_rpc("asyncrl_receive", args=args)
        except Exception as error:  # a worker that died or failed mid-load
            raise WeightTransferError(
                f"collective: v{offer.version} into vLLM failed: {error}", partial=True
            ) from error
        refused = [report for report in reports if report["refused"] and not report["error"]]
        if refused:
            raise WeightsRefused(
                f"collective v{offer.version}: refused: {refused[0]['refused']}",
                reason=NONFINITE,
                partial=any(report["fed"] for report in reports),
            )
        failed = [report for report in reports if report["error"]]
        if failed:
            reached = max(report["buckets"] for report in reports)
            raise WeightTransferError(
                f"collective: v{offer.version} into vLLM stopped after {reached} of "
                f"{len(offer.buckets)} buckets: {failed[0]['error']}",
                partial=reached > 0,
                deadline_missed=any(report["timed_out"] for report in failed),
                overwritten=all(report["overwritten"] for report in failed),
            )
        backend._reset_prefix_cache()  # no KV computed with the old weights is reused
        backend.version = offer.version
        backend.last_load_s = time.perf_counter() - started

    def leave_weight_group(self) -> None:
        self.backend.llm.collective_rpc("asyncrl_leave_group")
