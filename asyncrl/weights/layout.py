"""How a version's tensors become one byte stream cut into chunks, and back.

A version's tensors are laid end to end, in index order, as one byte stream
(each tensor C-contiguous), cut into chunks of ``chunk_bytes``: a chunk carries
the tail of a tensor begun in the chunk before, whole small tensors, and the
head of one that continues; a tensor larger than a chunk spans several. Both
ends derive the same layout from the tensor index (:func:`chunk_pieces`), so
the index is all a transfer needs to agree on. Nothing here depends on how the
bytes travel.
"""

from __future__ import annotations

import torch

from asyncrl.core.messages import TensorEntry

TORCH_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
FROM_NAME = {name: dtype for dtype, name in TORCH_DTYPES.items()}
DEFAULT_CHUNK_BYTES = 16 << 20
"""Bytes per chunk: big enough that a round trip per chunk costs nothing, small
enough that a chunk's receive buffer is reused by the allocator (glibc maps
anything above 32 MiB afresh, page faults and all, on every receive)."""

Piece = tuple[int, int, int]
"""``(tensor index, start byte, stop byte)`` within that tensor."""


def chunk_pieces(tensors: list[TensorEntry], chunk_bytes: int) -> list[list[Piece]]:
    """The pieces of each chunk, in stream order: the layout both ends derive from the index."""
    total = sum(entry.nbytes for entry in tensors)
    chunks: list[list[Piece]] = [[] for _ in range(-(-total // chunk_bytes))]
    for index, entry in enumerate(tensors):
        position, end = entry.offset, entry.offset + entry.nbytes
        while position < end:
            chunk = position // chunk_bytes
            stop = min(end, (chunk + 1) * chunk_bytes)
            chunks[chunk].append((index, position - entry.offset, stop - entry.offset))
            position = stop
    return chunks


def describe_pieces(tensors: list[TensorEntry], pieces: list[Piece], limit: int = 4) -> str:
    """The names of the tensors ``pieces`` belong to, for error messages."""
    names = [f"'{tensors[index].name}'" for index, _, _ in pieces]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "no tensors"


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
