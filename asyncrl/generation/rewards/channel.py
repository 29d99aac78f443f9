"""The wire between the scorer and a reward worker: length-prefixed frames.

The scorer sends job batches as msgpack (plain data: strings, numbers, lists, dicts;
numpy values as their Python equivalents); a worker replies in JSON, which the
scorer checks field by field (:func:`decode_reply`). Neither side unpickles: a
reward function that writes to the channel can cost its own sample and worker,
never run code in the generator or in another worker."""

from __future__ import annotations

import json
import math
import socket
import struct
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np

from asyncrl.generation.rewards.outcome import WORKER_ERRORS, clip, short_repr

FRAME = struct.Struct("!Q")
"""Every message on a worker's channel is this length, then that many bytes."""
MAX_REPLY_BYTES = 1 << 16
"""A worker's replies are small; a longer frame means the channel carries garbage."""
READ_BYTES = 1 << 20


def framed(payload: bytes) -> bytes:
    return FRAME.pack(len(payload)) + payload


def _plain(value: Any) -> Any:
    """numpy values (parquet rows, environments' extra_info) as plain Python data."""
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"cannot send a {type(value).__name__} to a reward worker")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_plain)


def encode_jobs(jobs: list | None) -> bytes:
    """A batch of ``(id, args)`` jobs, or None (leave), as one frame's payload."""
    return framed(_ENCODER.encode(jobs))


def decode_jobs(payload: bytes) -> list | None:
    """What :func:`encode_jobs` made (tuples arrive as lists)."""
    return msgspec.msgpack.decode(payload)


def read_exactly(channel: socket.socket, size: int) -> bytes | None:
    """``size`` bytes from ``channel``; None when it closes first."""
    data = bytearray()
    while len(data) < size:
        chunk = channel.recv(min(size - len(data), READ_BYTES))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def send_reply(channel: socket.socket, message: list) -> None:
    channel.sendall(framed(json.dumps(message).encode()))


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} in a reply")


def decode_reply(payload: bytes) -> list:
    """A worker's message, checked: ``["ready"]``, ``["failed", reason]`` or
    ``[job id, reward, error tag or None, detail]``. ValueError for anything else."""
    message = json.loads(payload, parse_constant=_reject_constant)
    match message:
        case ["ready"] | ["failed", str()]:
            return message
        case [int() as job_id, float() as reward, None | str() as error, str() as detail]:
            if isinstance(job_id, bool) or not math.isfinite(reward):
                raise ValueError(f"a reply with job {job_id!r} and reward {reward!r}")
            if error is not None and error not in WORKER_ERRORS:
                raise ValueError(f"a reply with an unknown error tag {short_repr(error)}")
            return [job_id, reward, error, clip(detail)]
    raise ValueError(f"not a reply: {short_repr(message)}")


def take_frames(inbox: bytearray) -> Iterator[bytes]:
    """The complete frames at the front of ``inbox``, each removed as it is taken (a partial
    one stays). ValueError, once the frames before it are taken, for a frame longer than
    any reply: garbage on the channel, which must not cost the replies that came first."""
    while len(inbox) >= FRAME.size:
        (size,) = FRAME.unpack_from(inbox)
        if size > MAX_REPLY_BYTES:
            raise ValueError(f"a frame of {size} bytes; replies are at most {MAX_REPLY_BYTES}")
        end = FRAME.size + size
        if len(inbox) < end:
            return
        frame = bytes(inbox[FRAME.size : end])
        del inbox[:end]
        yield frame
