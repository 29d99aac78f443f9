"""Each listening socket's limits derive from the config, and senders fit under them."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.buffer.validation import Limits
from asyncrl.config import MAX_PROCESSES, MAX_TOKENS, Config, load_config
from asyncrl.core.message_limits import (
    BUFFER_HEADER_BYTES,
    GENERATOR_HEADER_BYTES,
    MAX_SAMPLES_PER_MESSAGE,
    MIN_UNAUTHENTICATED,
    TRAJECTORY_MESSAGE_BYTES,
    buffer_frame_limit,
    buffer_guard_limits,
    largest_trajectories_message,
    longest_sample,
    sample_bytes,
    split_for_sending,
    widest_trajectory_frame,
)
from asyncrl.core.messages import Trajectories, TrajectoryMeta, encode
from asyncrl.core.trajectory import COLUMNS, Columns
from asyncrl.weights.zmq.limits import FRAME_MAX_BYTES, HELD_BYTES, guard_limits

TOOLS = [
    "environment.name=tools",
    "environment.tools=[python]",
    "environment.python_isolation=none",
]


def tiny(*overrides: str) -> Config:
    return load_config(None, ["model.tiny={}", *overrides])


def columns_for(lengths: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """Token columns of samples of these ``(prompt_len, response_len)``, as a message carries."""
    prompt = sum(p for p, _ in lengths)
    response = sum(r for _, r in lengths)
    return Columns(
        prompt_ids=np.ones(prompt, np.int32),
        response_ids=np.ones(response, np.int32),
        logprobs=np.zeros(response, np.float32),
        token_versions=np.zeros(response, np.int32),
        loss_mask=np.ones(response, np.uint8),
    ).to_wire()


def test_sample_bytes_counts_every_token_column():
    arrays = columns_for([(7, 5)])
    assert sample_bytes(7, 5) == sum(array.nbytes for array in arrays.values())
    assert set(arrays) == set(COLUMNS)


@pytest.mark.parametrize(
    "lengths",
    [
        [(100, 50)] * 1000,  # many small samples: the count caps them
        [(1024, 4096)] * 40,  # long samples: the bytes cap them
        [(10, 10), (1 << 16, 1 << 16), (10, 10), (10, 10)],  # one over the budget alone
        [],
    ],
    ids=["many small", "long", "one alone", "none"],
)
def test_split_for_sending_covers_every_sample_once_in_order_within_the_caps(lengths):
    parts = split_for_sending(lengths)
    covered = [i for part in parts for i in range(len(lengths))[part]]
    assert covered == list(range(len(lengths)))
    for part in parts:
        chunk = lengths[part]
        assert 1 <= len(chunk) <= MAX_SAMPLES_PER_MESSAGE
        assert len(chunk) == 1 or sum(sample_bytes(*s) for s in chunk) <= TRAJECTORY_MESSAGE_BYTES


def test_a_generator_s_largest_message_has_every_frame_under_the_buffer_s_cap():
    """The longest samples a config allows, as many as a replica can hold, split as the
    replica splits them: every frame is at most half the cap, the header well under it."""
    config = tiny("generators.max_new_tokens=4096", "data.max_prompt_tokens=2048")
    prompt, response = longest_sample(config)
    lengths = [(prompt, response)] * 300
    cap = buffer_frame_limit(config)
    long_id = "g" * 128
    for part in split_for_sending(lengths):
        metas = [
            TrajectoryMeta(2**40, 2**20, p, r, -1.5, "z" * 32, long_id, 1.5, "error:" + "e" * 40)
            for p, r in lengths[part]
        ]
        stats = {f"env_{'s' * 48}_{i}": 1e15 for i in range(64)}
        frames = encode(Trajectories(metas, stats, "p" * 32, 2**63 - 1), columns_for(lengths[part]))
        assert len(frames[0]) <= GENERATOR_HEADER_BYTES
        assert max(memoryview(f).nbytes for f in frames) <= widest_trajectory_frame(config)
        assert widest_trajectory_frame(config) * 2 <= cap


def test_the_longest_sample_is_the_one_the_buffer_s_validation_accepts():
    for overrides in (
        [],
        ["generators.pools=[{name: a, max_new_tokens: 9}, {name: b, max_new_tokens: 300}]"],
        TOOLS,
    ):
        config = tiny(*overrides)
        limits = Limits.from_config(config, vocab_size=None)
        assert longest_sample(config) == (limits.max_prompt_len, limits.max_response_len)


def test_the_buffer_s_frame_cap_follows_the_config_and_stays_far_below_2_gib():
    default = tiny()
    assert buffer_frame_limit(default) == 2 * BUFFER_HEADER_BYTES  # the decoded header
    longest = tiny(
        f"generators.max_new_tokens={MAX_TOKENS}", f"data.max_prompt_tokens={MAX_TOKENS}"
    )
    assert buffer_frame_limit(longest) == 2 * 4 * MAX_TOKENS  # one sample's widest column
    assert buffer_frame_limit(longest) < 1 << 31
    held = buffer_guard_limits(longest).held_bytes
    assert held == buffer_frame_limit(longest) + largest_trajectories_message(longest)


def test_connections_in_handshake_are_sized_for_every_replica_reconnecting_at_once():
    few = buffer_guard_limits(tiny("generators.replicas=2"))
    many = buffer_guard_limits(tiny(f"generators.replicas={MAX_PROCESSES}"))
    assert few.unauthenticated == MIN_UNAUTHENTICATED + 2 * (2 * 2 + 4)
    assert many.unauthenticated >= 2 * 2 * MAX_PROCESSES
    weights = guard_limits(replicas=3)
    assert weights.unauthenticated == MIN_UNAUTHENTICATED + 2 * (3 + 2)
    assert weights.frame_bytes == FRAME_MAX_BYTES
    assert weights.held_bytes == HELD_BYTES > FRAME_MAX_BYTES
