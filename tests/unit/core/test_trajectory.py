"""asyncrl.core.trajectory: the token columns' codec, and the one rule for a trajectory's
version."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from asyncrl.buffer.evaluation import outcome
from asyncrl.core.messages import Trajectories, TrajectoryMeta, decode, encode
from asyncrl.core.trajectory import (
    COLUMNS,
    ENV_VERSION,
    UNVERSIONED,
    ColumnLengthError,
    Columns,
    Sample,
    build_columns,
    is_versioned,
    join_samples,
    padded_layout,
    split_samples,
    trajectory_version,
)
from asyncrl.generation.envs.rollout import Trajectory
from asyncrl.generators.backend import Rollout
from asyncrl.learner.batch import collate

torch.set_num_threads(1)


def rollout(group_id: int, prompt: list[int], turns: list[tuple[str, list[int], int]]) -> Rollout:
    """A finished rollout whose response is ``turns``: ("model", ids, version) turns made by
    the policy, ("env", ids, _) replies appended as an environment's (mask 0, ENV_VERSION)."""
    r = Rollout(group_id, 0, list(prompt), ground_truth="", finish_reason="stop")
    for kind, ids, version in turns:
        model = kind == "model"
        r.response_ids += ids
        r.logprobs += [-0.5 if model else 0.0] * len(ids)
        r.token_versions += [version if model else ENV_VERSION] * len(ids)
        r.loss_mask += [int(model)] * len(ids)
    return r


def meta_of(r: Rollout) -> TrajectoryMeta:
    return TrajectoryMeta(
        r.group_id, r.sample_index, len(r.prompt_ids), len(r.response_ids), 1.0, "stop", "gen-0"
    )


ROLLOUTS = [
    rollout(1, [5, 6, 7], [("model", [8, 9], 4), ("env", [10], 0), ("model", [11], 3)]),
    rollout(2, [5], [("model", [12, 13, 14], 6)]),
    rollout(3, [5, 6], [("env", [15, 16], 0)]),  # the environment's tokens only
    rollout(4, [7, 7, 7, 7], []),  # nothing generated: the prompt filled the budget
]


def over_the_wire(columns: Columns, metas: list[TrajectoryMeta]):
    """Encoded, copied as a socket would, decoded: ``(metas, frames)`` as a receiver has them."""
    frames = [bytes(frame) for frame in encode(Trajectories(metas), columns.to_wire())]
    body, arrays = decode(frames)
    return body.samples, arrays


def test_columns_are_declared_once_and_every_stage_has_them():
    assert list(Trajectories.ARRAYS) == list(COLUMNS)
    assert {name: np.dtype(dtype) for name, dtype in Trajectories.ARRAYS.items()} == COLUMNS
    sample_columns = [f.name for f in dataclasses.fields(Sample) if f.name != "meta"]
    assert sample_columns == list(COLUMNS)
    made_by_a_rollout = {f.name for f in dataclasses.fields(Rollout)}
    assert set(COLUMNS) <= made_by_a_rollout


def test_build_encode_decode_split_join_round_trips_every_column():
    metas = [meta_of(r) for r in ROLLOUTS]
    received_metas, frames = over_the_wire(build_columns(ROLLOUTS), metas)

    samples = split_samples(received_metas, Columns.from_wire(frames))
    joined_metas, joined = join_samples(samples)

    assert joined_metas == metas
    for r, sample in zip(ROLLOUTS, samples, strict=True):
        for name, dtype in COLUMNS.items():
            column = getattr(sample, name)
            assert column.dtype == dtype
            np.testing.assert_array_equal(column, np.asarray(getattr(r, name), dtype))
    for name, dtype in COLUMNS.items():
        expected = np.concatenate([np.asarray(getattr(r, name), dtype) for r in ROLLOUTS])
        assert joined[name].dtype == dtype
        np.testing.assert_array_equal(joined[name], expected)


def test_join_copies_each_column_once_into_the_declared_dtype():
    metas = [meta_of(r) for r in ROLLOUTS]
    samples = split_samples(metas, build_columns(ROLLOUTS))
    reordered = [samples[1], samples[0]]
    widened = dataclasses.replace(samples[2], token_versions=samples[2].token_versions.astype(int))

    _, swapped = join_samples(reordered)
    _, cast = join_samples([widened])

    np.testing.assert_array_equal(swapped["response_ids"], [12, 13, 14, 8, 9, 10, 11])
    assert not np.shares_memory(swapped["response_ids"], samples[0].response_ids)
    assert cast["token_versions"].dtype == COLUMNS["token_versions"]
    np.testing.assert_array_equal(cast["token_versions"], [ENV_VERSION, ENV_VERSION])


def test_split_refuses_columns_the_lengths_do_not_add_up_to():
    metas = [meta_of(r) for r in ROLLOUTS]
    arrays = build_columns(ROLLOUTS).to_wire()
    arrays["loss_mask"] = arrays["loss_mask"][:-1]

    with pytest.raises(ColumnLengthError, match="loss_mask"):
        split_samples(metas, arrays)


def test_the_padded_layout_puts_each_prompt_then_its_response_at_the_left_of_its_row():
    metas = [meta_of(r) for r in ROLLOUTS[:2]]  # 3 + 4 and 1 + 3 tokens

    layout = padded_layout(metas)

    assert layout.width == 7
    assert layout.lengths.tolist() == [7, 4]
    prompt = list(zip(layout.prompt_rows, layout.prompt_columns, strict=True))
    response = list(zip(layout.response_rows, layout.response_columns, strict=True))
    assert prompt == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert response == [(0, 3), (0, 4), (0, 5), (0, 6), (1, 1), (1, 2), (1, 3)]


# ---------------------------------------------------------------- one version rule


def generators_version(r: Rollout) -> int:
    """The multi-turn driver's view: its Trajectory of the same tokens."""
    trajectory = Trajectory(
        token_ids=r.prompt_ids + r.response_ids,
        loss_mask=r.loss_mask,
        logprobs=r.logprobs,
        versions=r.token_versions,
        prompt_len=len(r.prompt_ids),
        num_turns=1,
        finish_reason="stop",
        reward=0.0,
        tool_calls=0,
        tool_errors=0,
    )
    return trajectory.min_version


def loss_mask_rule(r: Rollout) -> int:
    """The rule the driver used before: the oldest version among tokens with loss mask 1."""
    trained = [v for v, m in zip(r.token_versions, r.loss_mask, strict=True) if m]
    return min(trained) if trained else UNVERSIONED


def test_generators_buffer_and_learner_agree_on_each_trajectorys_version():
    metas = [meta_of(r) for r in ROLLOUTS]
    received_metas, frames = over_the_wire(build_columns(ROLLOUTS), metas)
    in_buffer = split_samples(received_metas, frames)
    batch = collate(received_metas, frames, pad_id=0)

    generators = [generators_version(r) for r in ROLLOUTS]
    buffer = [sample.version for sample in in_buffer]
    learner = batch.versions.tolist()
    evaluation = [outcome(s.meta, s.token_versions).version_min for s in in_buffer]

    # model tokens made at 4, 4, 3; 6, 6, 6; none (environment only); none (no response)
    assert generators == buffer == learner == [3, 6, UNVERSIONED, UNVERSIONED]
    assert generators == [loss_mask_rule(r) for r in ROLLOUTS]
    assert evaluation == [3, 6, -1, -1]  # eval rounds report "none" as -1
    assert is_versioned(batch.versions).tolist() == [True, True, False, False]


def test_a_version_is_the_oldest_model_token_whatever_the_order():
    assert trajectory_version([7, ENV_VERSION, 2, 9]) == 2
    assert trajectory_version(np.array([ENV_VERSION, ENV_VERSION], np.int32)) == UNVERSIONED
    assert trajectory_version([]) == UNVERSIONED
