"""How much one peer may send a listening socket, derived from the run's config.

ZeroMQ's ``ZMQ_MAXMSGSIZE`` caps each frame a peer sends, the handshake's commands
included: libzmq reads a frame's declared size first and drops the connection when
it is over the cap, before allocating anything. So each listening socket sets it
to the largest frame its role can legitimately receive, with a margin, and the
senders split whatever could be larger:

- **the buffer** receives the learner's small requests and the generators'
  ``Trajectories``. A generator puts at most ``TRAJECTORY_MESSAGE_BYTES`` of token
  columns and at most ``MAX_SAMPLES_PER_MESSAGE`` samples in one message
  (:func:`split_for_sending`); a sample bigger than that on its own goes alone, and
  none is longer than the config allows (``data.max_prompt_tokens``, the longest
  response of any pool or ``environment.max_total_tokens``). So its widest frame is
  at most ``max(TRAJECTORY_MESSAGE_BYTES, 4 bytes x the longest prompt or
  response)``, and its header at most ``GENERATOR_HEADER_BYTES``.
  :func:`buffer_frame_limit` is twice the larger of that and the header the buffer
  decodes (``BUFFER_HEADER_BYTES``): 2 MiB for every shipped config.
- **the weights server** receives requests of tens of bytes, whatever the config:
  its cap is the constant ``asyncrl.weights.zmq.limits.FRAME_MAX_BYTES`` (64 KiB).

libzmq does not bound a message's number of frames: it keeps a multipart message
whole until its last frame, 64 bytes per frame however small. The connection
guard (:mod:`asyncrl.core.connection_guard`) bounds that, and how many connections may
be in their handshake at once, with the limits below (:func:`buffer_guard_limits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from asyncrl.core.trajectory import PROMPT, RESPONSE, Columns

if TYPE_CHECKING:
    from asyncrl.config import Config

TRAJECTORY_MESSAGE_BYTES = 256 << 10
"""Token-column bytes a generator puts in one ``Trajectories`` message (20k response
tokens); more samples go in further messages."""
MAX_SAMPLES_PER_MESSAGE = 128
"""Samples in one ``Trajectories`` message: their metadata stays under
``GENERATOR_HEADER_BYTES`` whatever their ids and tags."""
GENERATOR_HEADER_BYTES = 128 << 10
"""The largest header a generator sends: ``MAX_SAMPLES_PER_MESSAGE`` samples' metadata
with the longest ids and tags validation allows take under 64 KB."""
BUFFER_HEADER_BYTES = 1 << 20
"""The largest header frame the buffer decodes; a larger one (up to the frame cap) is
refused as ``oversized`` and counted."""
FRAME_MARGIN = 2
"""Each socket's frame cap is this many times its largest legitimate frame."""
HANDSHAKE_TIMEOUT_S = 10.0
"""``ZMQ_HANDSHAKE_IVL``: libzmq drops a connection that has not finished its handshake
(greeting, credentials, ready) within this time; over loopback it takes milliseconds."""
MIN_UNAUTHENTICATED = 16
"""Connections in their handshake at once, beyond twice the ones the run's own peers open."""
BUFFER_SOCKETS_PER_REPLICA = 2
"""A generator replica connects to the buffer twice: its requests and its heartbeats."""
OTHER_BUFFER_PEERS = 4
"""The learner's connection, ``asyncrl status`` and the launcher's, with room to spare."""
COLUMN_ITEMSIZE = max(column.metadata["dtype"].itemsize for column in fields(Columns))
"""Bytes per token of the widest token column (int32 ids and versions, float32 log-probs)."""
BYTES_PER_TOKEN = {
    span: sum(c.metadata["dtype"].itemsize for c in fields(Columns) if c.metadata["span"] == span)
    for span in (PROMPT, RESPONSE)
}
"""Bytes a sample's columns take per prompt token (4) and per response token (13)."""


@dataclass(frozen=True)
class GuardLimits:
    """What :class:`~asyncrl.core.connection_guard.ConnectionGuard` allows one socket."""

    frame_bytes: int
    """``ZMQ_MAXMSGSIZE``: a larger frame, handshake command or not, drops its connection."""
    held_bytes: int
    """Bytes a connection may have sent that the server has not received yet: a frame at
    the cap and a whole legitimate message (a peer has one request out at a time; the
    heartbeat thread has a socket of its own), so no frame under the cap is cut by it."""
    unauthenticated: int
    """Connections not yet past their handshake at once; the oldest beyond are shut."""
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S


def longest_sample(config: Config) -> tuple[int, int]:
    """``(prompt tokens, response tokens)`` of the longest sample the buffer accepts
    (as :meth:`asyncrl.buffer.validation.Limits.from_config` bounds them)."""
    if config.environment is not None:
        response = config.environment.max_total_tokens
    else:
        response = max(p.settings.max_new_tokens for p in config.generators.resolved_pools())
    return config.data.max_prompt_tokens, response


def sample_bytes(prompt_len: int, response_len: int) -> int:
    """Bytes of one sample's token columns."""
    return prompt_len * BYTES_PER_TOKEN[PROMPT] + response_len * BYTES_PER_TOKEN[RESPONSE]


def split_for_sending(
    lengths: Sequence[tuple[int, int]],
    budget: int = TRAJECTORY_MESSAGE_BYTES,
    max_samples: int = MAX_SAMPLES_PER_MESSAGE,
) -> list[slice]:
    """Consecutive runs of samples (``(prompt_len, response_len)`` each), one message
    each: at most ``max_samples`` and ``budget`` bytes of columns, or one sample alone."""
    parts: list[slice] = []
    start, size = 0, 0
    for index, (prompt_len, response_len) in enumerate(lengths):
        this = sample_bytes(prompt_len, response_len)
        if index > start and (size + this > budget or index - start >= max_samples):
            parts.append(slice(start, index))
            start, size = index, 0
        size += this
    if start < len(lengths):
        parts.append(slice(start, len(lengths)))
    return parts


def widest_trajectory_frame(config: Config) -> int:
    """The largest array frame a generator sends (:func:`split_for_sending`)."""
    return max(TRAJECTORY_MESSAGE_BYTES, COLUMN_ITEMSIZE * max(longest_sample(config)))


def buffer_frame_limit(config: Config) -> int:
    """The buffer's ``ZMQ_MAXMSGSIZE``: ``FRAME_MARGIN`` x its largest legitimate frame."""
    return FRAME_MARGIN * max(BUFFER_HEADER_BYTES, widest_trajectory_frame(config))


def largest_trajectories_message(config: Config) -> int:
    """Bytes of the largest ``Trajectories`` a generator sends: header and columns."""
    one_sample = sample_bytes(*longest_sample(config))
    return GENERATOR_HEADER_BYTES + max(TRAJECTORY_MESSAGE_BYTES, one_sample)


def unauthenticated_limit(replicas: int, sockets_per_replica: int, others: int) -> int:
    """Connections allowed in their handshake at once: twice every connection the run's
    peers open (all of them reconnecting together), plus ``MIN_UNAUTHENTICATED``."""
    return MIN_UNAUTHENTICATED + 2 * (replicas * sockets_per_replica + others)


def total_replicas(config: Config) -> int:
    return sum(pool.replicas for pool in config.generators.resolved_pools())


def buffer_guard_limits(config: Config) -> GuardLimits:
    """The buffer's limits: frames, bytes held per connection, connections in handshake."""
    return GuardLimits(
        frame_bytes=buffer_frame_limit(config),
        held_bytes=buffer_frame_limit(config) + largest_trajectories_message(config),
        unauthenticated=unauthenticated_limit(
            total_replicas(config), BUFFER_SOCKETS_PER_REPLICA, OTHER_BUFFER_PEERS
        ),
    )
