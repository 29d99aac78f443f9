"""Turn a batch from the buffer into padded tensors for one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.messages import ArrayFrame, TrajectoryMeta


@dataclass
class TrainBatch:
    """Right-padded sequences; per-token fields are aligned with next-token logits.

    Position ``t`` of ``behavior_logprobs``, ``loss_mask`` and ``token_versions``
    describes token ``t + 1`` of ``input_ids``, the token predicted at ``t``.
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    behavior_logprobs: torch.Tensor  # [B, L-1]
    loss_mask: torch.Tensor  # [B, L-1]
    token_versions: torch.Tensor  # [B, L-1], -1 outside responses
    rewards: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B]
    versions: torch.Tensor  # [B], oldest token version of each sample
    response_lengths: torch.Tensor  # [B]

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]


def collate(metas: list[TrajectoryMeta], arrays: dict[str, ArrayFrame], pad_id: int) -> TrainBatch:
    flat = {name: frame.numpy() for name, frame in arrays.items()}
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
    sample_versions = torch.where(versions >= 0, versions, torch.iinfo(torch.long).max).amin(dim=1)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        behavior_logprobs=behavior,
        loss_mask=loss_mask,
        token_versions=versions,
        rewards=torch.tensor([m.reward for m in metas], dtype=torch.float32),
        group_ids=torch.tensor([m.group_id for m in metas]),
        versions=sample_versions,
        response_lengths=torch.tensor([m.response_len for m in metas]),
    )
