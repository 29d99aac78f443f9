"""What learner tests build on: a process group of one in this process, a synthetic
padded batch, and a small on-policy batch for the loss tests. Used by the unit,
integration (the FSDP worker script) and GPU tests and by the script that captured the
golden numbers.

Not a test module: ``from tests.helpers.learner import ...``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
RANK_ENV += ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""What would make the process group join a launched run's instead of its own."""


@contextmanager
def single_rank(device: str = "cpu") -> Iterator:
    """A process group of one in this process (gloo on CPU, NCCL on CUDA); the
    environment goes back afterwards, so the next test can make its own."""
    from asyncrl.learner import distributed

    saved = dict(os.environ)
    for name in RANK_ENV:
        os.environ.pop(name, None)
    try:
        yield distributed.init(device)
    finally:
        distributed.shutdown()
        os.environ.clear()
        os.environ.update(saved)


TINY_LEARNER = [
    "model.tiny.num_layers=2",
    "model.tiny.hidden_size=32",
    "model.tiny.intermediate_size=64",
    "algorithm.group_size=4",
    "algorithm.prompts_per_step=4",
    "learner.lr=0.01",
    "run.total_steps=10",
]
"""Config overrides of the learner tests' tiny model and batch (with the synthetic batches)."""
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


def on_policy_inputs():
    """Logprobs with grad; proximal and behavior equal to them (ratio 1, weight 1)."""
    torch.manual_seed(0)
    logprobs = (-torch.rand(2, 3) - 0.1).requires_grad_(True)
    proximal = logprobs.detach().clone()
    behavior = proximal.clone()
    advantages = torch.tensor([2.0, -0.5])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logprobs, proximal, behavior, advantages, mask
