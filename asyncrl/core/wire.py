"""The pieces every message shares: limits, the body base, array specs and frames.

A message is a ZeroMQ multipart message: a msgpack header, then one raw frame per
array the header names (see :mod:`asyncrl.core.messages`). This module holds what does
not depend on which messages exist: the size limits, :class:`WireError`, the
:class:`ArraySpec` a header names an array with, the supported dtypes, and the
checks that hold a body's array frames to what it declares. The message catalogue
and the codec built on it live in :mod:`asyncrl.core.messages`; the weights-transfer
messages in :mod:`asyncrl.core.weight_messages`.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar

import msgspec
import numpy as np

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 31
"""Default ceiling on one message (header plus frames); receivers may lower it."""
MAX_HEADER_BYTES = 64 << 20
"""Default ceiling on the header frame, checked before it is decoded; receivers may lower
it (the buffer takes 1 MiB: ``asyncrl.buffer.service.MAX_HEADER_BYTES``). A learner's
batch of thousands of samples, or a grant of many long prompts, stays far below it."""
MAX_ARRAY_DIMS = 8
"""An array (or a published tensor) has at most this many dimensions: checked while the
header is decoded, before any size is computed from its shape (a product over 100,000
dimensions would cost seconds of big-integer arithmetic)."""
MAX_ARRAY_DIM = 1 << 40
"""The largest size of one dimension: a product over ``MAX_ARRAY_DIMS`` of them stays a
small integer."""


Dimension = Annotated[int, msgspec.Meta(ge=0, le=MAX_ARRAY_DIM)]
Shape = Annotated[tuple[Dimension, ...], msgspec.Meta(max_length=MAX_ARRAY_DIMS)]
"""An array's shape: at most ``MAX_ARRAY_DIMS`` sizes, each in ``[0, MAX_ARRAY_DIM]``."""

DTYPES = {"int32", "int64", "float32", "float16", "bfloat16", "uint8", "bool"}
"""The dtypes an array frame (or a published tensor) may have."""
ITEMSIZE = {
    "int32": 4,
    "int64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "uint8": 1,
    "bool": 1,
}
"""Bytes per element of each of :data:`DTYPES` (bfloat16 has no numpy dtype to ask)."""


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    """The byte size of an array of ``dtype`` and ``shape``; Python ints: no overflow."""
    return math.prod(shape) * ITEMSIZE[dtype]


class WireError(ValueError):
    """A malformed message. ``reason`` is a short label for counting."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


class ArraySpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str
    shape: Shape


class _Body(msgspec.Struct, tag_field="type", forbid_unknown_fields=True):
    ARRAYS: ClassVar[dict[str, str]] = {}
    """Arrays this message carries, name -> dtype; empty for header-only messages."""


class ArrayFrame(msgspec.Struct, frozen=True):
    """A received array: its spec and a view of the frame's bytes (no copy)."""

    spec: ArraySpec
    buffer: memoryview

    def numpy(self) -> np.ndarray:
        """Read-only numpy view; bfloat16 has no numpy dtype (use torch.frombuffer)."""
        return np.frombuffer(self.buffer, dtype=np.dtype(self.spec.dtype)).reshape(self.spec.shape)


def array_frames(
    arrays: dict[str, np.ndarray] | None,
) -> tuple[list[ArraySpec], list[memoryview]]:
    """The specs a header names ``arrays`` with, and their frames (contiguous, not copied)."""
    specs, frames = [], []
    for name, array in (arrays or {}).items():
        array = np.ascontiguousarray(array)
        specs.append(ArraySpec(name, str(array.dtype), tuple(array.shape)))
        frames.append(memoryview(array).cast("B"))
    return specs, frames


def check_sizes(buffers: list[memoryview], max_bytes: int, max_header_bytes: int) -> None:
    """Reject a message over ``max_bytes`` or a header over ``max_header_bytes``
    (``oversized``) before a byte of it is decoded."""
    total = sum(b.nbytes for b in buffers)
    if total > max_bytes:
        raise WireError("oversized", f"{total} bytes exceeds the limit of {max_bytes}")
    if buffers[0].nbytes > max_header_bytes:
        raise WireError(
            "oversized",
            f"a header of {buffers[0].nbytes} bytes exceeds the limit of {max_header_bytes}",
        )


def header_error_reason(error: msgspec.ValidationError) -> str:
    """The counted reason for a header msgspec refused: an unknown body type, a bad
    array spec, or any other bad field."""
    where = str(error)
    if "`$.body.type`" in where:
        return "unknown_type"
    if "`$.arrays" in where:
        return "bad_array"
    return "bad_header"


def received_arrays(
    body: _Body, specs: list[ArraySpec], buffers: list[memoryview]
) -> dict[str, ArrayFrame]:
    """Hold the frames after the header to ``specs`` and to what ``body`` declares.

    One frame per spec (``frame_count``); each name once, declared by the body when it
    declares any, with its declared dtype, a supported dtype and a shape whose byte
    size is the frame's (``bad_array``, ``truncated``); every declared array present.
    """
    if len(specs) != len(buffers):
        raise WireError(
            "frame_count", f"header names {len(specs)} arrays, got {len(buffers)} frames"
        )
    arrays: dict[str, ArrayFrame] = {}
    for spec, buffer in zip(specs, buffers, strict=True):
        if spec.name in arrays:
            raise WireError("bad_array", f"array '{spec.name}' appears twice")
        expected = body.ARRAYS.get(spec.name)
        if body.ARRAYS and expected is None:
            raise WireError("bad_array", f"{body.__class__.__name__} has no array '{spec.name}'")
        if expected is not None and spec.dtype != expected:
            raise WireError(
                "bad_array", f"array '{spec.name}' must be {expected}, got {spec.dtype}"
            )
        if spec.dtype not in DTYPES or any(dim < 0 for dim in spec.shape):
            raise WireError(
                "bad_array", f"array '{spec.name}': unsupported {spec.dtype}{spec.shape}"
            )
        nbytes = nbytes_of(spec.dtype, spec.shape)
        if nbytes != buffer.nbytes:
            raise WireError(
                "truncated",
                f"array '{spec.name}' {spec.shape} needs {nbytes} bytes, frame has {buffer.nbytes}",
            )
        arrays[spec.name] = ArrayFrame(spec, buffer)
    missing = set(body.ARRAYS) - set(arrays)
    if missing:
        raise WireError(
            "bad_array", f"{body.__class__.__name__} is missing arrays {sorted(missing)}"
        )
    return arrays
