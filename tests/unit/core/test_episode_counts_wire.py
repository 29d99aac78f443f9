"""An episode's counts on the wire (``TrajectoryMeta.episode``): sent only by multi-turn
samples, bounded while decoding, and within the generator's header budget."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from asyncrl.core.message_limits import GENERATOR_HEADER_BYTES, MAX_SAMPLES_PER_MESSAGE
from asyncrl.core.messages import (
    MAX_EPISODE_COUNT,
    SCHEMA_VERSION,
    EpisodeCounts,
    Trajectories,
    TrajectoryMeta,
    WireError,
    decode,
    encode,
)


def one_token_arrays(n: int) -> dict[str, np.ndarray]:
    return {
        "prompt_ids": np.ones(n, np.int32),
        "response_ids": np.ones(n, np.int32),
        "logprobs": np.zeros(n, np.float32),
        "loss_mask": np.ones(n, np.uint8),
        "token_versions": np.zeros(n, np.int32),
    }


def meta(**fields) -> TrajectoryMeta:
    return TrajectoryMeta(1, 0, 1, 1, 1.0, "stop", "gen-0", **fields)


def wire(body: Trajectories) -> list[bytes]:
    return [bytes(frame) for frame in encode(body, one_token_arrays(len(body.samples)))]


def test_an_episode_s_counts_travel_and_a_single_turn_sends_none():
    counts = EpisodeCounts(turns=3, tool_calls=2, tool_errors=1)
    decoded, _ = decode(wire(Trajectories([meta(episode=counts)])))
    assert decoded.samples[0].episode == counts
    single = wire(Trajectories([meta()]))
    assert b"episode" not in single[0]  # left out of the bytes, as before the field
    assert decode(single)[0].samples[0].episode is msgspec.UNSET


def test_tool_success_needs_a_call_that_did_not_fail():
    assert EpisodeCounts(2, 3, 2).tool_succeeded
    assert not EpisodeCounts(2, 3, 3).tool_succeeded
    assert not EpisodeCounts(1, 0, 0).tool_succeeded


@pytest.mark.parametrize(
    "counts",
    [
        {"turns": -1, "tool_calls": 0, "tool_errors": 0},
        {"turns": 1, "tool_calls": MAX_EPISODE_COUNT + 1, "tool_errors": 0},
        {"turns": 1, "tool_calls": 2, "tool_errors": -2},
        {"turns": 1, "tool_calls": 2},  # a count left out
        {"turns": 1, "tool_calls": 2, "tool_errors": 0, "extra": 1},
    ],
    ids=str,
)
def test_counts_out_of_bounds_or_out_of_shape_are_refused_while_decoding(counts):
    body = msgspec.to_builtins(Trajectories([meta()]))
    body["samples"][0]["episode"] = counts
    envelope = {"schema_version": SCHEMA_VERSION, "body": body, "arrays": []}
    with pytest.raises(WireError) as caught:
        decode([msgspec.msgpack.encode(envelope)])
    assert caught.value.reason == "bad_header"
    assert "episode" in str(caught.value)


def test_a_full_message_of_episodes_stays_within_the_generator_s_header_budget():
    big = EpisodeCounts(MAX_EPISODE_COUNT, MAX_EPISODE_COUNT, MAX_EPISODE_COUNT)
    metas = [
        TrajectoryMeta(
            2**40, 2**20, 1, 1, -1.5, "z" * 32, "g" * 128, 1.5, "error:" + "e" * 40, 2**40, big
        )
        for _ in range(MAX_SAMPLES_PER_MESSAGE)
    ]
    stats = {f"env_{'s' * 48}_{i}": 1e15 for i in range(64)}
    frames = encode(Trajectories(metas, stats, "p" * 32, 2**63 - 1), one_token_arrays(len(metas)))
    assert len(frames[0]) <= GENERATOR_HEADER_BYTES
