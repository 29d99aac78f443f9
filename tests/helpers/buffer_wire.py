"""What the buffer's integration tests send it, built as generators and the learner build it.

A test talks to a real buffer (a thread or its own process) over TCP: one
encoded message per request on a DEALER socket, ``Trajectories`` of one group
with their array frames. The test keeps its own sizes and timings and passes
them in; nothing here asserts more than that a reply is of the expected type.

Every run authenticates its peers (``cluster.auth``): ``buffer_config`` gives
each config credentials of its own, all of which the test process holds (it
plays every role), and :class:`Peers` hands out sockets of each role
(generator, learner, observer) with that role's credentials, as
``client_context`` gives them to the real roles.

A generator's samples carry the prompt its group was handed out with (the
buffer checks them): :func:`exchange` notes the prompt of every item a
``WorkGrant`` brings, and :func:`trajectories` sends it for that group.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import zmq

from asyncrl.config import ClusterConfig, Config, load_config
from asyncrl.core.credentials import held
from asyncrl.core.keys_folder import hold_every_role
from asyncrl.core.messages import (
    Ack,
    Message,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    decode,
    encode,
)
from asyncrl.core.security import GENERATOR, LEARNER, OBSERVER, Role, client_context
from asyncrl.core.transport import client_socket, free_port, tcp

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
PROMPT_LEN = 4
RESPONSE_LEN = 3
"""Tokens per sample of ``trajectories`` unless a test asks for others."""
PROMPTS: dict[int, list[int]] = {}
"""Group id -> the prompt ids it was handed out with, as :func:`exchange` saw them (one
test process talks to buffers of one dataset: a group id names one prompt)."""


def fresh_keys_dir() -> Path:
    """A keys folder of a new run whose every credential this process holds, removed when
    the test process exits."""
    directory = Path(tempfile.mkdtemp(prefix="asyncrl-test-keys-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    hold_every_role(ClusterConfig(keys_dir=str(directory)))
    return directory


def buffer_config(
    *overrides: str,
    group_size: int,
    prompts_per_step: int = 2,
    heartbeat_timeout_s: float | None = None,
    heartbeat_interval_s: float | None = None,
    keys_dir: Path | None = None,
) -> Config:
    """The quickstart config with small steps, free ports, the test's heartbeat times and
    credentials of its own (new ones, unless this process holds those of ``keys_dir``).

    ``None`` keeps quickstart's heartbeat setting; ``overrides`` are applied last, so
    they win over everything else.
    """
    if keys_dir is None:
        keys_dir = fresh_keys_dir()
    elif held(ClusterConfig(keys_dir=str(keys_dir))) is None:
        hold_every_role(ClusterConfig(keys_dir=str(keys_dir)))
    settings = [
        f"algorithm.group_size={group_size}",
        f"algorithm.prompts_per_step={prompts_per_step}",
        f"cluster.buffer_port={free_port()}",
        f"cluster.weights_port={free_port()}",
        f"cluster.keys_dir={keys_dir}",
    ]
    if heartbeat_timeout_s is not None:
        settings.append(f"buffer.heartbeat_timeout_s={heartbeat_timeout_s}")
    if heartbeat_interval_s is not None:
        settings.append(f"buffer.heartbeat_interval_s={heartbeat_interval_s}")
    return load_config(QUICKSTART, [*settings, *overrides])


class Endpoint(Protocol):
    """A buffer a test talks to (``RunningBuffer``, or one in its own process)."""

    config: Config
    endpoint: str


class Peers:
    """Client sockets of the run's roles: each role's socket comes from a context holding
    that role's credentials for the buffer's run. ``close`` destroys them all."""

    def __init__(self) -> None:
        self.contexts: dict[tuple[str | None, str], zmq.Context] = {}

    def context(self, config: Config, role: Role) -> zmq.Context:
        key = (config.cluster.keys_dir, role)
        if key not in self.contexts:
            self.contexts[key] = client_context(config.cluster, role)
        return self.contexts[key]

    def socket(self, buffer: Endpoint, role: Role, timeout_s: float = 5.0) -> zmq.Socket:
        return client_socket(self.context(buffer.config, role), buffer.endpoint, timeout_s)

    def generator(self, buffer: Endpoint, timeout_s: float = 5.0) -> zmq.Socket:
        return self.socket(buffer, GENERATOR, timeout_s)

    def learner(self, buffer: Endpoint, timeout_s: float = 5.0) -> zmq.Socket:
        return self.socket(buffer, LEARNER, timeout_s)

    def observer(self, buffer: Endpoint, timeout_s: float = 5.0) -> zmq.Socket:
        return self.socket(buffer, OBSERVER, timeout_s)

    def close(self) -> None:
        for context in self.contexts.values():
            context.destroy(linger=0)
        self.contexts.clear()


def buffer_endpoint(config: Config) -> str:
    return tcp("127.0.0.1", config.cluster.buffer_port)


def note_prompts(reply: Any) -> Any:
    """Remember the prompts a WorkGrant hands out (:data:`PROMPTS`); returns ``reply``."""
    if isinstance(reply, WorkGrant):
        for item in reply.items:
            PROMPTS[item.group_id] = list(item.prompt_ids)
    return reply


def exchange_frames(sock: zmq.Socket, frames: Sequence) -> tuple[Any, dict[str, Any]]:
    """Send one multipart message exactly as given (well-formed or not); the reply's
    body and arrays, decoded."""
    sock.send_multipart(frames)
    reply, arrays = decode(sock.recv_multipart())
    return note_prompts(reply), arrays


def exchange(sock: zmq.Socket, body: Message, arrays: dict[str, np.ndarray] | None = None) -> Any:
    """Send ``body`` (with ``arrays``) as one encoded message; the reply's body."""
    reply, _ = exchange_frames(sock, encode(body, arrays))
    return reply


def trajectories(
    group_id: int,
    indices: Sequence[int],
    generator_id: str,
    *,
    prompt_ids: Sequence[int] | None = None,
    prompt_len: int = PROMPT_LEN,
    response_len: int = RESPONSE_LEN,
    reward: float | Callable[[int], float] = 0.5,
    generate_time_s: float = 0.0,
    stats: dict[str, float] | None = None,
    incarnation: int = 0,
) -> tuple[Trajectories, dict[str, np.ndarray]]:
    """Samples ``indices`` of one group from ``generator_id``, packed as a generator packs
    them: a Trajectories body and its concatenated token arrays.

    The prompt is ``prompt_ids``, else the one the group was handed out with
    (:data:`PROMPTS`), else ``prompt_len`` ones (a group never handed out).
    ``reward`` is every sample's reward, or a function of the sample index.
    """
    if prompt_ids is None:
        prompt_ids = PROMPTS.get(group_id, [1] * prompt_len)
    prompt_len = len(prompt_ids)
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
        "prompt_ids": np.tile(np.asarray(prompt_ids, dtype=np.int32), n),
        "response_ids": np.full(response_len * n, 4, dtype=np.int32),
        "logprobs": np.full(response_len * n, -0.5, dtype=np.float32),
        "token_versions": np.zeros(response_len * n, dtype=np.int32),
        "loss_mask": np.ones(response_len * n, dtype=np.uint8),
    }
    return Trajectories(metas, stats or {}, incarnation=incarnation), arrays


def send_samples(
    sock: zmq.Socket, group_id: int, indices: Sequence[int], generator_id: str, **options: Any
) -> Ack:
    """Send samples ``indices`` of one group (``options`` as ``trajectories`` takes them)
    and return the buffer's Ack: how many it accepted and rejected."""
    ack = exchange(sock, *trajectories(group_id, indices, generator_id, **options))
    assert isinstance(ack, Ack), ack
    return ack
