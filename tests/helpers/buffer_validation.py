"""Checking a generator's message as the buffer does, against small limits, and building one."""

from __future__ import annotations

import numpy as np

from asyncrl.buffer.validation import (
    Limits,
    check_trajectories,
)
from asyncrl.core.messages import (
    Trajectories,
    TrajectoryMeta,
    decode,
    encode,
)
from tests.helpers.buffer_samples import make_store

VOCAB = 50


LIMITS = Limits(
    vocab_size=VOCAB,
    reward_min=-1.0,
    reward_max=1.0,
    max_response_len=8,
    max_prompt_len=16,
    own_prompts=False,
)


PROMPT = [1, 2]
"""``buffer_samples.make_store``'s prompt, for every group."""


def message(
    group_ids=(0,),
    samples: int = 2,
    *,
    generator_id: str = "gen-0",
    response_len: int = 3,
    prompt: list[int] | None = None,
    reward: float = 0.5,
    indices: list[int] | None = None,
    stats: dict[str, float] | None = None,
    **meta_fields,
) -> tuple[Trajectories, dict[str, np.ndarray]]:
    """A generator's message: ``samples`` samples of each group, as it packs them (through
    the codec, so the arrays are what the buffer would read)."""
    prompt = PROMPT if prompt is None else prompt
    keys = [(g, i) for g in group_ids for i in (indices or range(samples))]
    metas = [
        TrajectoryMeta(g, i, len(prompt), response_len, reward, "stop", generator_id, **meta_fields)
        for g, i in keys
    ]
    n = len(keys)
    arrays = {
        "prompt_ids": np.tile(np.asarray(prompt, np.int32), n),
        "response_ids": np.full(response_len * n, 7, np.int32),
        "logprobs": np.full(response_len * n, -0.25, np.float32),
        "token_versions": np.zeros(response_len * n, np.int32),
        "loss_mask": np.ones(response_len * n, np.uint8),
    }
    body, frames = decode([bytes(f) for f in encode(Trajectories(metas, stats or {}), arrays)])
    return body, {name: frame.numpy().copy() for name, frame in frames.items()}


def check(body, arrays, limits: Limits = LIMITS, latest: int = 1, store=None, errors=None):
    store = store or make_store(group_size=2)
    errors = set() if errors is None else errors
    return check_trajectories(body, arrays, limits, latest, store.handed_out, errors)


def held_store():
    """A store that handed groups 0 and 1 (two samples each) to gen-0."""
    store = make_store(group_size=2, samples_per_step=4)
    assert [item.group_id for item in store.dispatch("gen-0", 4)] == [0, 1]
    return store
