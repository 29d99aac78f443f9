"""collate: a buffer batch on the wire -> right-padded tensors aligned with next-token logits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from asyncrl.core.messages import Trajectories, TrajectoryMeta, decode, encode
from asyncrl.learner.batch import collate

torch.set_num_threads(1)

PAD = 0


def meta(group_id: int, index: int, prompt_len: int, response_len: int, reward: float):
    return TrajectoryMeta(
        group_id=group_id,
        sample_index=index,
        prompt_len=prompt_len,
        response_len=response_len,
        reward=reward,
        finish_reason="stop",
        generator_id="gen-0",
    )


def wire_batch():
    """Sample A: prompt [11, 12, 13], response [21, 22] made at versions [4, 5].
    Sample B: prompt [31, 32], response [41, 42, 43, 44] made at versions [6, 6, 3, 7].
    Sent through encode/decode, as the learner receives it."""
    metas = [meta(7, 0, 3, 2, 1.0), meta(9, 1, 2, 4, 0.25)]
    arrays = {
        "prompt_ids": np.array([11, 12, 13, 31, 32], dtype=np.int32),
        "response_ids": np.array([21, 22, 41, 42, 43, 44], dtype=np.int32),
        "logprobs": np.array([-0.1, -0.2, -1.1, -1.2, -1.3, -1.4], dtype=np.float32),
        "token_versions": np.array([4, 5, 6, 6, 3, 7], dtype=np.int32),
        "loss_mask": np.array([1, 1, 1, 0, 1, 1], dtype=np.uint8),
    }
    body, frames = decode(encode(Trajectories(metas), arrays))
    return body.samples, frames


def test_input_ids_are_prompt_then_response_right_padded_to_the_longest_sample():
    batch = collate(*wire_batch(), pad_id=PAD)
    # A: 3 + 2 = 5 tokens, B: 2 + 4 = 6 tokens -> width 6
    expected = torch.tensor(
        [
            [11, 12, 13, 21, 22, PAD],
            [31, 32, 41, 42, 43, 44],
        ]
    )
    assert batch.input_ids.dtype == torch.long
    assert torch.equal(batch.input_ids, expected)
    assert batch.num_samples == 2


def test_the_attention_mask_covers_exactly_the_real_tokens():
    batch = collate(*wire_batch(), pad_id=PAD)
    expected = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert torch.equal(batch.attention_mask, expected)


def test_the_pad_id_fills_the_padding():
    batch = collate(*wire_batch(), pad_id=99)
    assert batch.input_ids[0, 5].item() == 99
    assert (batch.input_ids[1] != 99).all()


def test_behavior_logprobs_sit_at_the_positions_that_predict_their_tokens():
    batch = collate(*wire_batch(), pad_id=PAD)
    # width 6 -> per-token fields have 5 positions; position t predicts input token t + 1.
    # A: response tokens are input positions 3, 4 -> predicted at 2, 3 (prompt_len - 1 = 2 on)
    # B: response tokens are input positions 2..5 -> predicted at 1..4 (prompt_len - 1 = 1 on)
    expected = torch.tensor(
        [
            [0.0, 0.0, -0.1, -0.2, 0.0],
            [0.0, -1.1, -1.2, -1.3, -1.4],
        ]
    )
    assert batch.behavior_logprobs.shape == (2, 5)
    torch.testing.assert_close(batch.behavior_logprobs, expected)


def test_loss_mask_is_aligned_like_the_logprobs_and_zero_outside_responses():
    batch = collate(*wire_batch(), pad_id=PAD)
    expected = torch.tensor(
        [
            [0.0, 0.0, 1.0, 1.0, 0.0],
            [0.0, 1.0, 0.0, 1.0, 1.0],
        ]
    )
    assert torch.equal(batch.loss_mask, expected)


def test_token_versions_are_aligned_and_minus_one_outside_responses():
    batch = collate(*wire_batch(), pad_id=PAD)
    expected = torch.tensor(
        [
            [-1, -1, 4, 5, -1],
            [-1, 6, 6, 3, 7],
        ]
    )
    assert torch.equal(batch.token_versions, expected)


def test_the_aligned_positions_predict_the_response_tokens():
    batch = collate(*wire_batch(), pad_id=PAD)
    # where a response token is recorded, the next input token is that response token
    targets = batch.input_ids[:, 1:]
    recorded = batch.token_versions >= 0
    assert targets[recorded].tolist() == [21, 22, 41, 42, 43, 44]


def test_a_samples_version_is_its_oldest_token_version():
    batch = collate(*wire_batch(), pad_id=PAD)
    # A: min(4, 5) = 4; B: min(6, 6, 3, 7) = 3
    assert batch.versions.tolist() == [4, 3]


def test_per_sample_fields_come_from_the_metas():
    batch = collate(*wire_batch(), pad_id=PAD)
    assert batch.rewards.tolist() == pytest.approx([1.0, 0.25])
    assert batch.rewards.dtype == torch.float32
    assert batch.group_ids.tolist() == [7, 9]
    assert batch.response_lengths.tolist() == [2, 4]


def per_row_collate(metas, flat, pad_id):
    """The collate before the padded batch was built on the device, row by row: the
    reference the vectorized one must match exactly (its code, kept here as it was)."""
    lengths = [m.prompt_len + m.response_len for m in metas]
    size, width = len(metas), max(lengths)
    input_ids = torch.full((size, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((size, width), dtype=torch.long)
    behavior = torch.zeros((size, width - 1))
    loss_mask = torch.zeros((size, width - 1))
    versions = torch.full((size, width - 1), -1, dtype=torch.long)
    p = r = 0
    for row, meta in enumerate(metas):
        prompt = flat["prompt_ids"][p : p + meta.prompt_len]
        response = slice(r, r + meta.response_len)
        tokens = np.concatenate([prompt, flat["response_ids"][response]])
        input_ids[row, : len(tokens)] = torch.from_numpy(tokens.astype(np.int64))
        attention_mask[row, : len(tokens)] = 1
        targets = slice(meta.prompt_len - 1, meta.prompt_len - 1 + meta.response_len)
        behavior[row, targets] = torch.from_numpy(flat["logprobs"][response].copy())
        loss_mask[row, targets] = torch.from_numpy(flat["loss_mask"][response].astype(np.float32))
        versions[row, targets] = torch.from_numpy(flat["token_versions"][response].astype(np.int64))
        p += meta.prompt_len
        r += meta.response_len
    return input_ids, attention_mask, behavior, loss_mask, versions


@pytest.mark.parametrize("seed", range(5))
def test_a_random_batch_is_laid_out_exactly_as_row_by_row(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 9))
    metas = [
        meta(g, 0, int(rng.integers(1, 6)), int(rng.integers(0, 7)), float(g)) for g in range(size)
    ]
    prompt_total = sum(m.prompt_len for m in metas)
    response_total = sum(m.response_len for m in metas)
    mask = rng.integers(0, 2, response_total).astype(np.uint8)
    arrays = {
        "prompt_ids": rng.integers(3, 50, prompt_total).astype(np.int32),
        "response_ids": rng.integers(3, 50, response_total).astype(np.int32),
        "logprobs": -rng.random(response_total).astype(np.float32),
        "token_versions": np.where(mask == 1, rng.integers(0, 9, response_total), -1).astype(
            np.int32
        ),
        "loss_mask": mask,
    }
    body, frames = decode(encode(Trajectories(metas), arrays))

    batch = collate(body.samples, frames, pad_id=PAD)

    expected = per_row_collate(metas, arrays, PAD)
    got = (
        batch.input_ids,
        batch.attention_mask,
        batch.behavior_logprobs,
        batch.loss_mask,
        batch.token_versions,
    )
    for have, want in zip(got, expected, strict=True):
        assert have.dtype == want.dtype
        assert torch.equal(have, want)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ),
    ],
)
def test_every_field_is_built_on_the_device_asked_for(device):
    on_cpu = collate(*wire_batch(), pad_id=PAD)

    batch = collate(*wire_batch(), pad_id=PAD, device=device)

    for field in dataclasses.fields(batch):
        tensor = getattr(batch, field.name)
        assert tensor.device.type == device, field.name
        assert torch.equal(tensor.cpu(), getattr(on_cpu, field.name)), field.name
