"""A buffer service that records what it sends, and the samples a generator sends it."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from asyncrl.buffer.main import build_store
from asyncrl.buffer.service import BufferService
from asyncrl.config import load_config
from asyncrl.core.messages import (
    Trajectories,
    TrajectoryMeta,
    WorkItem,
    decode,
    encode,
)
from asyncrl.generation.tasks import work_item_factory

LEARNER = b"learner"


class Recorded(BufferService):
    """A BufferService whose replies are kept, by peer, instead of sent."""

    def __init__(self, *overrides: str):
        config = load_config(
            None,
            [
                "model.tiny={}",
                "algorithm.group_size=2",
                "algorithm.prompts_per_step=2",
                "buffer.max_staleness=0",
                *overrides,
            ],
        )
        super().__init__(config, build_store(config, work_item_factory(config)), "inproc://x")
        self.replies: dict[bytes, list] = {}

    async def _reply(self, identity: bytes, body, arrays=None) -> bool:
        self.replies.setdefault(identity, []).append(body)
        return True

    def handle(self, identity: bytes, body, arrays=None) -> None:
        asyncio.run(self._handle(identity, body, arrays or {}))
        asyncio.run(self.generators.serve_held(time.monotonic()))  # as the serve loop does

    def last(self, identity: bytes):
        return self.replies[identity][-1]

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def samples_of(item: WorkItem, generator_id: str, reward: float = 1.0, version: int = 0):
    """The whole group of ``item`` as a generator sends it (through the codec)."""
    n = item.num_samples
    metas = [
        TrajectoryMeta(item.group_id, i, len(item.prompt_ids), 1, reward, "stop", generator_id,
                       0.0, "", item.eval_round)
        for i in range(n)
    ]  # fmt: skip
    arrays = {
        "prompt_ids": np.tile(np.asarray(item.prompt_ids, np.int32), n),
        "response_ids": np.ones(n, np.int32),
        "logprobs": np.zeros(n, np.float32),
        "token_versions": np.full(n, version, np.int32),
        "loss_mask": np.ones(n, np.uint8),
    }
    return decode([bytes(frame) for frame in encode(Trajectories(metas), arrays)])
