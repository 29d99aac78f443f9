"""The run itself: its name and length, the model, and where metrics go."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from asyncrl.config.base import MAX_TOKENS, Section, directory_name_problem
from asyncrl.config.environment import DAY_S, Float


class RunConfig(Section):
    name: str = "run"
    """Prefix of the run directory's name: no `/`, `\\`, `..` or control characters."""
    seed: StrictInt = Field(0, ge=0, lt=2**32)
    """Seeds the dataset order, model init and sampling (numpy takes 0 to 2**32 - 1)."""
    total_steps: StrictInt = Field(100, ge=1, le=10**9)
    """Learner steps (optimizer updates) to run."""
    output_dir: str = "runs"
    """Where run directories are created, unless `--run-dir` names one."""
    stall_timeout_s: Float = Field(900.0, ge=0.0, le=7 * DAY_S)
    """A role (learner, buffer, generator) that makes no progress this long is reported
    and the run stops; 0 turns the watchdog off, else at least 10 s."""

    @field_validator("name")
    @classmethod
    def _name_is_a_directory_name(cls, value: str) -> str:
        """The name becomes a directory under `output_dir`: it must stay one, right there."""
        problem = directory_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("output_dir")
    @classmethod
    def _output_dir_is_a_path(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("contains a NUL character, which no path may hold")
        return value

    @field_validator("stall_timeout_s")
    @classmethod
    def _stall_timeout_sane(cls, value: float) -> float:
        if 0.0 < value < 10.0:
            raise ValueError(
                f"{value} s is below 10 s: slow steps would be reported as stalls; "
                "use 0 to turn the watchdog off"
            )
        return value


class TinyModelConfig(Section):
    """A small Qwen2-style causal LM built from a config: no download needed."""

    hidden_size: StrictInt = Field(64, ge=8, le=65536)
    num_layers: StrictInt = Field(2, ge=1, le=1024)
    num_heads: StrictInt = Field(4, ge=1, le=1024)
    intermediate_size: StrictInt = Field(128, ge=8, le=262144)
    max_position_embeddings: StrictInt = Field(128, ge=8, le=MAX_TOKENS)


class LoraConfig(Section):
    """LoRA adapters (made by peft): only they train, the base weights stay frozen.

    The defaults are what RL trainers that offer LoRA ship (rank 16, alpha 32, every
    linear layer but the LM head, no dropout): dropout would make the learner's
    log-probs noisy against the generators' for the same tokens.
    """

    rank: StrictInt = Field(16, ge=1, le=4096)
    """The adapters' rank r: each adapted ``[out, in]`` weight trains ``r * (in + out)``
    parameters."""
    alpha: Float = Field(32.0, gt=0.0, le=1e6)
    """Scales the adapters' product by ``alpha / rank``."""
    dropout: Float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input, in the learner's passes only (0: none)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The linear layers given adapters: ``all-linear`` (every one but the LM head) or
    module names as peft matches them (``[q_proj, v_proj]``)."""
    publish: Literal["adapter", "merged"] = "adapter"
    """What each weight sync moves: ``adapter``, the adapters alone (kilobytes to megabytes;
    each engine applies them as an adapter, and every sample is checked against the
    adapter published), or ``merged``, the whole model with the adapters folded in (for an
    engine without LoRA support)."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: list[str] | str) -> list[str] | str:
        if isinstance(value, list) and (not value or not all(name.strip() for name in value)):
            raise ValueError("name at least one module, none of them empty, or all-linear")
        return value


class ModelConfig(Section):
    name_or_path: str | None = None
    """A Hugging Face model name or local path. Leave empty to build `tiny`."""
    tiny: TinyModelConfig | None = None
    """Build a small model from this config with the built-in tokenizer."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (needs the ``lora`` extra: peft);
    empty: full fine-tuning."""

    @property
    def publishes_adapters(self) -> bool:
        """True when each weight sync moves LoRA adapters alone (``lora.publish: adapter``)."""
        return self.lora is not None and self.lora.publish == "adapter"

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        if (self.name_or_path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.name_or_path or model.tiny")
        return self


class TrackingConfig(Section):
    aim: bool = True
    """Track metrics in an aim repo inside the run directory (false: metrics.jsonl only)."""
    generations_per_step: StrictInt = Field(2, ge=0, le=1000)
    """Sampled generations (prompt, response, reward) sent to aim as text each step."""
