"""A synthetic padded batch for learner tests: unit, integration (the FSDP worker
script), GPU, and the script that captured the golden numbers.

Not a test module; each user puts ``tests/`` on ``sys.path`` (the unit tests' conftest
does it for them).
"""

from __future__ import annotations

import torch

GROUP = 4
"""Samples per prompt group in the synthetic batches."""


def synthetic_batch(step: int, vocab: int, size: int = 16, width: int = 12, seed: int = 1000):
    """Ragged sequences with a prompt of 3 tokens, random rewards, groups of four; the
    same ``(step, seed)`` gives the same batch."""
    from asyncrl.learner.batch import TrainBatch  # the golden script imports it from old code

    generator = torch.Generator().manual_seed(seed + step)
    lengths = torch.randint(5, width + 1, (size,), generator=generator)
    input_ids = torch.randint(3, vocab, (size, width), generator=generator)
    attention_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    loss_mask = torch.zeros(size, width - 1)
    for row, length in enumerate(lengths.tolist()):
        loss_mask[row, 2 : length - 1] = 1
    return TrainBatch(
        input_ids=input_ids * attention_mask,
        attention_mask=attention_mask,
        behavior_logprobs=-torch.rand(size, width - 1, generator=generator) * 3,
        loss_mask=loss_mask,
        token_versions=torch.where(loss_mask.bool(), step, -1),
        rewards=torch.rand(size, generator=generator),
        group_ids=torch.arange(size) // GROUP,
        versions=torch.full((size,), step),
        response_lengths=lengths - 3,
    )
