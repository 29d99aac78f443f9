"""Weights published to a replica and tampered with, for the weight transport tests."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

import torch

from asyncrl.config import GeneratorsConfig, ModelConfig, TinyModelConfig
from asyncrl.generation.models import build_policy, tied_names
from asyncrl.generators.hf_backend import HFBackend, Rollout
from asyncrl.weights.shm.segment import HEADER, INDEX_DECODER, PAGE, SLOT_HEADER, SLOT_HEADER_BYTES

EMBEDDING = "model.embed_tokens.weight"


def make_backend() -> HFBackend:
    model, tokenizer = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    return HFBackend(model, tokenizer, GeneratorsConfig(max_new_tokens=6, chunk_tokens=3))


BASE = make_backend().model


HEAD = tied_names(BASE)[1]


def published(version: int) -> dict[str, torch.Tensor]:
    """What the learner publishes as ``version``: the initial tensors moved by ``version``,
    the tied LM head left out (as the learner does)."""
    return {
        name: tensor * (1.0 + version / 100) + version / 1000
        for name, tensor in BASE.state_dict().items()
        if name != HEAD
    }


def holds(backend: HFBackend, tensors: dict[str, torch.Tensor]) -> bool:
    state = backend.model.state_dict()
    return all(torch.equal(state[name], tensor) for name, tensor in tensors.items())


def sample(backend: HFBackend) -> list[Rollout]:
    rollouts = [Rollout(0, i, [1, 3 + i, 13], "x") for i in range(2)]
    backend.generate_chunk(rollouts, 3)
    return rollouts


def tamper(segment: Path, version: int, name: str, values: bytes) -> None:
    """Write ``values`` over the first bytes of tensor ``name`` in the complete slot holding
    ``version`` of ``segment``, as any process of the run's user can."""
    with open(segment, "r+b") as file, mmap.mmap(file.fileno(), 0) as mapped:
        slot_bytes = HEADER.unpack_from(mapped, 0)[3]
        for slot in range(2):
            start = PAGE + slot * slot_bytes
            seq, held, _, index_nbytes, data_at, *_ = SLOT_HEADER.unpack_from(mapped, start)
            if seq % 2 == 0 and held == version:
                index_at = start + SLOT_HEADER_BYTES
                index = INDEX_DECODER.decode(mapped[index_at : index_at + index_nbytes])
                (entry,) = [e for e in index if e.name == name]
                at = start + data_at + entry.offset
                mapped[at : at + len(values)] = values
                return
    raise AssertionError(f"no complete slot holds v{version}")


NAN = struct.pack("<4f", math.nan, 1.0, math.inf, -math.inf)
