"""collate: a buffer batch on the wire -> right-padded tensors aligned with next-token logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.learner.batch import collate
from asyncrl.messages import Trajectories, TrajectoryMeta, decode, encode

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
