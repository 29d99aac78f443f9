"""Colocated GPUs: the learner's device tensors shared by CUDA IPC handle instead of copied.

When the learner and an engine worker use the same GPU, the worker can map the
learner's tensors directly: :func:`export_handles` turns device tensors into
their IPC handles (``torch.multiprocessing.reductions.reduce_tensor``, the
mechanism ``torch.multiprocessing`` uses between processes), written as
msgpack of plain fields, never a pickle; :func:`import_handles` maps them in
the other process, checking every field. The exporter must keep the tensors
alive (and unchanged) until the importer has copied them into its model.

Written for issue 18 and tested only on a CUDA machine (``tests/gpu/``); not
yet a path of the chain: the collective sender would offer handles instead of
broadcasting when both ends report the same device UUID (:func:`device_uuid`).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch

from asyncrl.weights.layout import FROM_NAME, TORCH_DTYPES

MAX_HANDLES_BYTES = 64 << 20


class Handle(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One tensor's IPC handle and view, as ``reduce_tensor`` gives them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


_DECODER = msgspec.msgpack.Decoder(list[Handle])


def ipc_available() -> bool:
    """The guard: CUDA IPC needs a CUDA device (and is never tried on CPU machines)."""
    return torch.cuda.is_available()


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: both ends compare them to know they share one device."""
    return str(torch.cuda.get_device_properties(device).uuid)


def export_handles(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """IPC handles of CUDA ``tensors`` (kept alive and unchanged by the caller)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    handles = []
    for name, tensor in tensors.items():
        if tensor.device.type != "cuda" or tensor.dtype not in TORCH_DTYPES:
            raise ValueError(f"tensor '{name}' is not a CUDA tensor of a supported dtype")
        rebuild, args = reduce_tensor(tensor.detach())
        if rebuild is not rebuild_cuda_tensor:
            raise ValueError(f"tensor '{name}' cannot be shared by CUDA IPC")
        size, stride, offset = args[1:4]  # args[0], [4], [5]: tensor class, storage class, dtype
        device, handle, storage_bytes, storage_offset = args[6:10]  # [10]: requires_grad
        ref_handle, ref_offset, event_handle, event_sync = args[11:15]
        handles.append(
            Handle(
                name,
                TORCH_DTYPES[tensor.dtype],
                tuple(size),
                tuple(stride),
                offset,
                int(device),
                bytes(handle),
                storage_bytes,
                storage_offset,
                bytes(ref_handle),
                ref_offset,
                None if event_handle is None else bytes(event_handle),
                bool(event_sync),
            )
        )
    return msgspec.msgpack.encode(handles)


def import_handles(data: bytes) -> dict[str, torch.Tensor]:
    """Map the tensors of :func:`export_handles` into this process (no copy)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if len(data) > MAX_HANDLES_BYTES:
        raise ValueError(f"{len(data)} bytes of IPC handles")
    tensors = {}
    for h in _DECODER.decode(data):
        if h.dtype not in FROM_NAME or not 0 <= h.device < torch.cuda.device_count():
            raise ValueError(f"tensor '{h.name}': dtype {h.dtype!r} on device {h.device}")
        if len(h.shape) != len(h.stride) or min((*h.shape, *h.stride, h.offset, 0)) < 0:
            raise ValueError(f"tensor '{h.name}': shape {h.shape}, stride {h.stride}")
        tensors[h.name] = rebuild_cuda_tensor(
            torch.Tensor, h.shape, h.stride, h.offset, torch.storage.TypedStorage,
            FROM_NAME[h.dtype], h.device, h.handle, h.storage_bytes, h.storage_offset, False,
            h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required,
        )  # fmt: skip
    return tensors
