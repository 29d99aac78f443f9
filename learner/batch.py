"""A batch from the buffer as padded tensors for one forward pass: the padded-batch stage.

The trajectory's columns and the rule for its version live in
:mod:`asyncrl.core.trajectory`; this module only lays them out on the learner's
device. :func:`collate` copies each flat column to the device once and
scatters it into place there, so rank 0's batch never goes through padded
host tensors first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.core.messages import ArrayFrame, TrajectoryMeta
from asyncrl.core.trajectory import (
    ENV_VERSION,
    UNVERSIONED,
    Columns,
    padded_layout,
    split_samples,
)


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
    token_versions: torch.Tensor  # [B, L-1], ENV_VERSION (-1) outside responses
    rewards: torch.Tensor  # [B]
    group_ids: torch.Tensor  # [B]
    versions: torch.Tensor  # [B], each sample's trajectory_version (UNVERSIONED: none)
    response_lengths: torch.Tensor  # [B]

    @property
    def num_samples(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def padding(
        cls, size: int, width: int, pad_id: int, device: torch.device | str = "cpu"
    ) -> TrainBatch:
        """``size`` rows of ``width`` tokens that are all padding, on ``device``: what
        :func:`collate` writes samples into, and what other ranks receive rank 0's batch
        into. Its shapes and dtypes are the batch's layout (on the ``meta`` device, the
        layout alone)."""
        per_token = (size, width - 1)
        return cls(
            input_ids=torch.full((size, width), pad_id, dtype=torch.long, device=device),
            attention_mask=torch.zeros((size, width), dtype=torch.long, device=device),
            behavior_logprobs=torch.zeros(per_token, dtype=torch.float32, device=device),
            loss_mask=torch.zeros(per_token, dtype=torch.float32, device=device),
            token_versions=torch.full(per_token, ENV_VERSION, dtype=torch.long, device=device),
            rewards=torch.zeros(size, dtype=torch.float32, device=device),
            group_ids=torch.zeros(size, dtype=torch.long, device=device),
            versions=torch.full((size,), UNVERSIONED, dtype=torch.long, device=device),
            response_lengths=torch.zeros(size, dtype=torch.long, device=device),
        )


def collate(
    metas: list[TrajectoryMeta],
    arrays: Mapping[str, ArrayFrame],
    pad_id: int,
    device: torch.device | str = "cpu",
) -> TrainBatch:
    """A buffer batch (one message's metas and column frames) padded on ``device``."""
    columns = Columns.from_wire(arrays)
    samples = split_samples(metas, columns)  # views; each knows its version
    layout = padded_layout(metas)
    size, width = len(metas), layout.width
    batch = TrainBatch.padding(size, width, pad_id, device)

    def on_device(values: np.ndarray, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)  # one copy, host to device

    prompt_at = on_device(layout.prompt_rows * width + layout.prompt_columns)
    response_at = on_device(layout.response_rows * width + layout.response_columns)
    # the per-token fields sit one left of their token: position t predicts token t + 1
    target_at = on_device(layout.response_rows * (width - 1) + layout.response_columns - 1)
    batch.input_ids.view(-1)[prompt_at] = on_device(columns.prompt_ids)
    batch.input_ids.view(-1)[response_at] = on_device(columns.response_ids)
    lengths = on_device(layout.lengths)
    batch.attention_mask[:] = torch.arange(width, device=device) < lengths[:, None]
    batch.behavior_logprobs.view(-1)[target_at] = on_device(columns.logprobs, torch.float32)
    batch.loss_mask.view(-1)[target_at] = on_device(columns.loss_mask, torch.float32)
    batch.token_versions.view(-1)[target_at] = on_device(columns.token_versions)
    batch.rewards[:] = torch.tensor([m.reward for m in metas], dtype=torch.float32)
    batch.group_ids[:] = torch.tensor([m.group_id for m in metas], dtype=torch.long)
    batch.versions[:] = torch.tensor([s.version for s in samples], dtype=torch.long)
    batch.response_lengths[:] = torch.tensor([m.response_len for m in metas], dtype=torch.long)
    return batch
