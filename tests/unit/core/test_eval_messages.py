"""Eval on the wire: StartEval, and the eval_round of WorkItem and TrajectoryMeta."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from asyncrl.core.messages import (
    SCHEMA_VERSION,
    StartEval,
    Trajectories,
    TrajectoryMeta,
    WireError,
    WorkGrant,
    WorkItem,
    decode,
    encode,
)


def header(body: dict) -> bytes:
    return msgspec.msgpack.encode({"schema_version": SCHEMA_VERSION, "body": body, "arrays": []})


def reason_of(frames) -> str:
    with pytest.raises(WireError) as caught:
        decode(frames)
    return caught.value.reason


def one_sample(meta: dict) -> list[bytes]:
    """A Trajectories message of one 1-token sample whose meta is ``meta`` (hand-built)."""
    arrays = [
        ["prompt_ids", "int32", [1]],
        ["response_ids", "int32", [1]],
        ["logprobs", "float32", [1]],
        ["token_versions", "int32", [1]],
        ["loss_mask", "uint8", [1]],
    ]
    head = msgspec.msgpack.encode(
        {
            "schema_version": SCHEMA_VERSION,
            "body": {"type": "trajectories", "samples": [meta]},
            "arrays": arrays,
        }
    )
    return [head, b"\0" * 4, b"\0" * 4, b"\0" * 4, b"\0" * 4, b"\0"]


META = {
    "group_id": -1,
    "sample_index": 0,
    "prompt_len": 1,
    "response_len": 1,
    "reward": 1.0,
    "finish_reason": "stop",
    "generator_id": "gen-0",
}


def test_start_eval_round_trips():
    body, arrays = decode(encode(StartEval(round=3, policy_version=30)))
    assert body == StartEval(3, 30) and arrays == {}


def test_an_eval_work_item_and_an_eval_sample_round_trip_with_their_round():
    grant = WorkGrant([WorkItem(-2, 4, [1, 2], "x", "s", eval_round=5)], policy_version=9)
    assert decode(encode(grant))[0] == grant
    meta = TrajectoryMeta(-2, 1, 2, 1, 0.5, "length", "gen-0", eval_round=5)
    arrays = {
        "prompt_ids": np.array([1, 2], np.int32),
        "response_ids": np.array([3], np.int32),
        "logprobs": np.array([-0.5], np.float32),
        "token_versions": np.array([9], np.int32),
        "loss_mask": np.array([1], np.uint8),
    }
    body, _ = decode(encode(Trajectories([meta]), arrays))
    assert body.samples == [meta]


def test_messages_without_the_field_are_training_work():
    item = {"group_id": 4, "num_samples": 2, "prompt_ids": [1], "ground_truth": "x"}
    grant, _ = decode([header({"type": "work_grant", "items": [item], "policy_version": 0})])
    assert grant.items[0].eval_round == -1
    body, _ = decode(one_sample(META))
    assert body.samples[0].eval_round == -1


@pytest.mark.parametrize(
    "frames",
    [
        one_sample(META | {"eval_round": -2}),
        one_sample(META | {"eval_round": "1"}),
        [header({"type": "start_eval", "round": -1, "policy_version": 0})],
        [header({"type": "start_eval", "round": 1, "policy_version": -3})],
        [header({"type": "start_eval", "round": 1})],
        [header({"type": "start_eval", "round": 1, "policy_version": 2, "samples": 5})],
        [
            header(
                {
                    "type": "work_grant",
                    "items": [{"group_id": -1, "num_samples": 1, "prompt_ids": [1],
                               "ground_truth": "x", "eval_round": 1.5}],
                    "policy_version": 0,
                }
            )
        ],
    ],
    ids=[
        "round below -1",
        "round as text",
        "negative StartEval round",
        "negative StartEval version",
        "StartEval without version",
        "StartEval unknown field",
        "fractional WorkItem round",
    ],
)  # fmt: skip
def test_a_malformed_eval_field_is_rejected_as_bad_header(frames):
    assert reason_of(frames) == "bad_header"
