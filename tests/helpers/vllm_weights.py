"""A vLLM engine fed weights over the collective path, and greedy generation to compare."""

from __future__ import annotations

from asyncrl.config import Config, GeneratorsConfig, ModelConfig, TinyModelConfig, WeightsConfig
from asyncrl.generators.backend import Rollout

MODEL = ModelConfig(
    tiny=TinyModelConfig(
        hidden_size=128, num_layers=2, num_heads=2, intermediate_size=256,
        max_position_embeddings=256,
    )
)  # fmt: skip


BUCKET_BYTES = 64 << 10  # several buckets, so layers arrive bucket by bucket


def greedy(backend, prompts: list[list[int]]) -> list[list[int]]:
    rollouts = [Rollout(0, i, prompt, "") for i, prompt in enumerate(prompts)]
    while not all(r.finished for r in rollouts):
        backend.generate_chunk(rollouts, 8)
    return [r.response_ids for r in rollouts]


def engine_config(transport: str) -> Config:
    sampling = GeneratorsConfig(backend="vllm", top_k=1, max_new_tokens=12, chunk_tokens=8)
    return Config(model=MODEL, generators=sampling, weights=WeightsConfig(transport=transport))
