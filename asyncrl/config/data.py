"""What is trained on and how it is scored: the task, prompt files, evaluation, rewards."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from asyncrl.config.base import MAX_PROCESSES, MAX_TOKENS, Section, spec_parts
from asyncrl.config.environment import DAY_S, Float


class TaskConfig(Section):
    """The built-in synthetic task (see :mod:`asyncrl.generation.tasks`)."""

    name: Literal["digits"] = "digits"
    """`digits`: given a string of digits, answer each digit plus `shift`, mod 10."""
    num_digits: StrictInt = Field(3, ge=1, le=16)
    shift: StrictInt = Field(1, ge=1, le=9)


class DataConfig(Section):
    """Prompts from files in the verl layout (see docs/data-and-rewards.md)."""

    train_files: list[str] = Field(default_factory=list)
    """Parquet or JSONL files of prompts; empty: the built-in `task`."""
    max_prompt_tokens: StrictInt = Field(1024, ge=1, le=MAX_TOKENS)
    """Prompts longer than this, once rendered with the chat template, are skipped (counted)."""
    shuffle: bool = True
    """Visit the prompts in a fresh order each epoch, seeded by `run.seed` and the epoch."""


class EvalConfig(Section):
    """Held-out evaluation during training, run by the generators (docs/evaluation.md)."""

    every_steps: StrictInt = Field(0, ge=0)
    """Evaluate the policy every this many learner steps, right after publishing its
    weights; 0: no evaluation. A multiple of `learner.sync_interval`."""
    files: list[str] = Field(default_factory=list)
    """Parquet or JSONL files of held-out prompts in the verl layout (like
    `data.train_files`); empty: held-out prompts of the built-in `task`, which
    training never draws."""
    max_prompts: StrictInt = Field(64, ge=1, le=1_000_000)
    """Prompts per round: a fixed sample of `files` (drawn with `run.seed`), the same
    in every round; all of them if there are fewer."""
    samples_per_prompt: StrictInt = Field(1, ge=1, le=4096)
    """Samples generated per prompt, with the run's sampling settings."""
    before_training: bool = False
    """Also evaluate the initial policy (a round at version 0)."""
    at_end: bool = True
    """Also evaluate the final policy: after the last step the learner starts a round of
    version `run.total_steps` and waits for it (and for a round still running) before
    it exits; the result is the last line of metrics.jsonl and `final/eval.json`."""
    final_timeout_s: Float = Field(600.0, gt=0.0, le=DAY_S)
    """How long the learner waits for the final round's results (and a round still
    running) after the last step; past it the final eval is skipped, and logged."""

    @property
    def enabled(self) -> bool:
        return self.every_steps > 0


class RewardConfig(Section):
    """How samples are scored (see :mod:`asyncrl.generation.rewards`)."""

    function: str | None = None
    """module:function or path.py:function; empty: chosen by each row's data_source."""
    timeout_s: Float = Field(10.0, gt=0, le=DAY_S)
    """A sample whose reward takes longer scores 0, tagged `error:timeout`; also each call
    `asyncrl validate` and `launch` make to `function` on a first row, to check it."""
    load_timeout_s: Float = Field(60.0, gt=0, le=DAY_S)
    """The time `asyncrl validate`, `launch` and each generator give the import of
    `function`, or the building of the environment (in a child process): one slower is
    stopped and named. A module that imports torch takes seconds, more on a busy machine."""
    workers: StrictInt = Field(1, ge=1, le=MAX_PROCESSES)
    """Scoring processes per generator replica."""
    memory_limit_mb: StrictInt = Field(4096, ge=64, le=1_048_576)
    """Address-space limit of each reward worker process, in MiB, and of the child process
    that imports `function` and the environment's module to check them."""
    min: Float = -10.0
    """The lowest reward a sample may carry. The buffer refuses a generator's message with a
    reward below `min`, above `max` or not finite (`buffer_rejected_bad_reward`), so no peer
    can feed the learner a reward far outside the task's scale. The shipped reward functions
    score in [0, 1] and the shipped environments' episodes in [0, 1]; widen the range for a
    task whose rewards (or an environment's summed step rewards) go beyond [-10, 10]."""
    max: Float = 10.0
    """The highest reward a sample may carry (see `min`)."""

    @field_validator("function")
    @classmethod
    def _spec_form(cls, value: str | None) -> str | None:
        if value is not None and spec_parts(value) is None:
            raise ValueError(f"expected module:function or path/to/file.py:function, got {value!r}")
        return value

    @model_validator(mode="after")
    def _range(self) -> RewardConfig:
        if self.min > self.max:
            raise ValueError(f"reward.min={self.min} is above reward.max={self.max}")
        return self
