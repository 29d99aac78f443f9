"""What the buffer's integration tests send it, built as generators and the learner build it.

A test talks to a real buffer (a thread or its own process) over TCP: one
encoded message per request on a REQ socket, ``Trajectories`` of one group
with their array frames. The test keeps its own sizes and timings and passes
them in; nothing here asserts more than that a reply is of the expected type.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from asyncrl.config import Config, load_config
from asyncrl.messages import Ack, Message, Trajectories, TrajectoryMeta, decode, encode
from asyncrl.transport import free_port

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
PROMPT_LEN = 4
RESPONSE_LEN = 3
"""Tokens per sample of ``trajectories`` unless a test asks for others."""


def buffer_config(
    *overrides: str,
    group_size: int,
    prompts_per_step: int = 2,
    heartbeat_timeout_s: float | None = None,
    heartbeat_interval_s: float | None = None,
) -> Config:
    """The quickstart config with small steps, free ports and the test's heartbeat times.

    ``None`` keeps quickstart's heartbeat setting; ``overrides`` are applied last, so
    they win over everything else.
    """
    settings = [
        f"algorithm.group_size={group_size}",
        f"algorithm.prompts_per_step={prompts_per_step}",
        f"cluster.buffer_port={free_port()}",
        f"cluster.weights_port={free_port()}",
    ]
    if heartbeat_timeout_s is not None:
        settings.append(f"buffer.heartbeat_timeout_s={heartbeat_timeout_s}")
    if heartbeat_interval_s is not None:
        settings.append(f"buffer.heartbeat_interval_s={heartbeat_interval_s}")
    return load_config(QUICKSTART, [*settings, *overrides])


def exchange_frames(sock: zmq.Socket, frames: Sequence) -> tuple[Any, dict[str, Any]]:
    """Send one multipart message exactly as given (well-formed or not); the reply's
    body and arrays, decoded."""
    sock.send_multipart(frames)
    return decode(sock.recv_multipart())


def exchange(sock: zmq.Socket, body: Message, arrays: dict[str, np.ndarray] | None = None) -> Any:
    """Send ``body`` (with ``arrays``) as one encoded message; the reply's body."""
    reply, _ = exchange_frames(sock, encode(body, arrays))
    return reply


def trajectories(
    group_id: int,
    indices: Sequence[int],
    generator_id: str,
    *,
    prompt_len: int = PROMPT_LEN,
    response_len: int = RESPONSE_LEN,
    reward: float | Callable[[int], float] = 0.5,
    generate_time_s: float = 0.0,
    stats: dict[str, float] | None = None,
) -> tuple[Trajectories, dict[str, np.ndarray]]:
    """Samples ``indices`` of one group from ``generator_id``, packed as a generator packs
    them: a Trajectories body and its concatenated token arrays.

    ``reward`` is every sample's reward, or a function of the sample index.
    """
    n = len(indices)
    metas = [
        TrajectoryMeta(
            group_id,
            index,
            prompt_len,
            response_len,
            reward(index) if callable(reward) else reward,
            "stop",
            generator_id,
            generate_time_s,
        )
        for index in indices
    ]
    arrays = {
        "prompt_ids": np.ones(prompt_len * n, dtype=np.int32),
        "response_ids": np.full(response_len * n, 4, dtype=np.int32),
        "logprobs": np.full(response_len * n, -0.5, dtype=np.float32),
        "token_versions": np.zeros(response_len * n, dtype=np.int32),
        "loss_mask": np.ones(response_len * n, dtype=np.uint8),
    }
    return Trajectories(metas, stats or {}), arrays


def send_samples(
    sock: zmq.Socket, group_id: int, indices: Sequence[int], generator_id: str, **options: Any
) -> Ack:
    """Send samples ``indices`` of one group (``options`` as ``trajectories`` takes them)
    and return the buffer's Ack: how many it accepted and rejected."""
    ack = exchange(sock, *trajectories(group_id, indices, generator_id, **options))
    assert isinstance(ack, Ack), ack
    return ack
