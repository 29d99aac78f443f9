"""The generators: sampling, engine backend, and named pools of replicas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, StrictInt, model_validator

from asyncrl.config.base import MAX_PROCESSES, MAX_TOKENS, Section
from asyncrl.config.environment import Float


class GeneratorsConfig(Section):
    replicas: StrictInt = Field(2, ge=1, le=MAX_PROCESSES)
    backend: Literal["hf", "vllm"] = "hf"
    """`hf`: transformers `generate` (the default); `vllm`: vLLM's engine (extra `vllm[-cpu]`)."""
    chunk_tokens: StrictInt = Field(4, ge=1, le=MAX_TOKENS)
    """Tokens generated between checks for newer weights (partial rollouts)."""
    max_new_tokens: StrictInt = Field(8, ge=1, le=MAX_TOKENS)
    temperature: Float = Field(1.0, gt=0.0)
    top_p: Float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0, le=1 << 24)
    """0 disables top-k."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: a sample ends (finish reason `stop`) with the token that completes one."""
    vllm_kv_cache_gb: Float = Field(1.0, gt=0, le=65536.0)
    """vLLM: KV cache memory per replica, in GiB (CPU or GPU memory)."""
    vllm_enforce_eager: bool = True
    """vLLM: skip CUDA graphs and torch.compile (starts fast; turn off for GPU throughput)."""
    vllm_prefix_caching: bool = True
    """vLLM: reuse the KV of shared prefixes within one weight version (reset on every load)."""
    vllm_in_process: bool = True
    """vLLM: run the engine core in the generator process (no IPC or idle polling; best on CPU)."""
    max_active_samples: StrictInt = Field(64, ge=1, le=65536)
    """Sequences one replica generates together."""
    num_threads: StrictInt = Field(1, ge=1, le=MAX_PROCESSES)
    num_cpus: Float = Field(1.0, ge=0.0)
    """CPUs each replica asks for (Ray resources)."""
    num_gpus: Float = Field(0.0, ge=0.0)
    """GPUs each replica asks for (Ray resources; fractions share a GPU)."""
    pools: list[PoolConfig] = Field(default_factory=list)
    """Named pools of replicas, each scaled on its own; empty: one pool, `default`,
    of `replicas` replicas with the settings above."""

    @model_validator(mode="after")
    def _pool_names_unique(self) -> GeneratorsConfig:
        names = [pool.name for pool in self.pools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"generators.pools: duplicate pool name(s) {duplicates}")
        return self

    def resolved_pools(self) -> list[Pool]:
        """Every pool with its effective settings: the section's, then the pool's overrides."""
        if not self.pools:
            return [Pool("default", self.replicas, self.model_copy(update={"pools": []}))]
        resolved = []
        for pool in self.pools:
            overrides = pool.model_dump(exclude={"name", "replicas"}, exclude_none=True)
            settings = self.model_copy(update={**overrides, "pools": [], "replicas": pool.replicas})
            resolved.append(Pool(pool.name, pool.replicas, settings))
        return resolved


class PoolConfig(Section):
    """One pool of generator replicas; unset fields inherit from `generators`.

    The sampling temperature is the run's (`generators.temperature`): the learner
    scores every sample at that temperature, so a pool cannot change it."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$")
    replicas: StrictInt = Field(1, ge=0, le=MAX_PROCESSES)
    backend: Literal["hf", "vllm"] | None = None
    chunk_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    max_new_tokens: StrictInt | None = Field(None, ge=1, le=MAX_TOKENS)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0, le=1 << 24)
    stop: list[str] | None = None
    max_active_samples: StrictInt | None = Field(None, ge=1, le=65536)
    num_threads: StrictInt | None = Field(None, ge=1, le=MAX_PROCESSES)
    num_cpus: Float | None = Field(None, ge=0.0)
    num_gpus: Float | None = Field(None, ge=0.0)
    vllm_kv_cache_gb: Float | None = Field(None, gt=0, le=65536.0)
    vllm_enforce_eager: bool | None = None
    vllm_prefix_caching: bool | None = None
    vllm_in_process: bool | None = None


@dataclass(frozen=True)
class Pool:
    """A pool as the launcher starts it: name, replica count, effective settings."""

    name: str
    replicas: int
    settings: GeneratorsConfig
