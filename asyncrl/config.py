"""The run configuration: a typed schema, loaded from YAML plus overrides.

``load_config("configs/quickstart.yaml", ["buffer.max_staleness=2"])`` returns a
validated :class:`Config` or raises :class:`ConfigError`, whose message holds
one line per problem, each naming where it came from (``file:line`` or the
override), the key path, and what was expected; an unknown key also names the
closest valid one. Every error is reported at once, before any process starts.

This module imports no torch, so ``asyncrl --help`` and validation stay fast.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from asyncrl.envs.config import DAY_S, EnvironmentConfig, Float
from asyncrl.machine import machine_problems  # noqa: F401  (re-exported)
from asyncrl.yaml_files import (
    MAX_CONFIG_BYTES,
    YamlFileError,
    YamlRefused,
    parse_yaml,
    read_yaml_file,
)

MAX_TOKENS = 1 << 20
"""Upper bound of every token count: far above any model's context, far below an overflow."""
MAX_PROCESSES = 1024
"""Upper bound of replicas, ranks, workers and threads: more would only exhaust the machine."""


class _Section(BaseModel):
    """Strict base: unknown keys are errors, not silently ignored; no float may be inf or nan
    (every float here is a rate, a coefficient, a size or a timeout)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(_Section):
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
        problem = _directory_name_problem(value)
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


class TinyModelConfig(_Section):
    """A small Qwen2-style causal LM built from a config: no download needed."""

    hidden_size: StrictInt = Field(64, ge=8, le=65536)
    num_layers: StrictInt = Field(2, ge=1, le=1024)
    num_heads: StrictInt = Field(4, ge=1, le=1024)
    intermediate_size: StrictInt = Field(128, ge=8, le=262144)
    max_position_embeddings: StrictInt = Field(128, ge=8, le=MAX_TOKENS)


class ModelConfig(_Section):
    name_or_path: str | None = None
    """A Hugging Face model name or local path. Leave empty to build `tiny`."""
    tiny: TinyModelConfig | None = None
    """Build a small model from this config with the built-in tokenizer."""
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelConfig:
        if (self.name_or_path is None) == (self.tiny is None):
            raise ValueError("set exactly one of model.name_or_path or model.tiny")
        return self


class TaskConfig(_Section):
    """The built-in synthetic task (see :mod:`asyncrl.tasks`)."""

    name: Literal["digits"] = "digits"
    """`digits`: given a string of digits, answer each digit plus `shift`, mod 10."""
    num_digits: StrictInt = Field(3, ge=1, le=16)
    shift: StrictInt = Field(1, ge=1, le=9)


class DataConfig(_Section):
    """Prompts from files in the verl layout (see docs/data-and-rewards.md)."""

    train_files: list[str] = []
    """Parquet or JSONL files of prompts; empty: the built-in `task`."""
    max_prompt_tokens: StrictInt = Field(1024, ge=1, le=MAX_TOKENS)
    """Prompts longer than this, once rendered with the chat template, are skipped (counted)."""
    shuffle: bool = True
    """Visit the prompts in a fresh order each epoch, seeded by `run.seed` and the epoch."""


class EvalConfig(_Section):
    """Held-out evaluation during training, run by the generators (docs/evaluation.md)."""

    every_steps: StrictInt = Field(0, ge=0)
    """Evaluate the policy every this many learner steps, right after publishing its
    weights; 0: no evaluation. A multiple of `learner.sync_interval`."""
    files: list[str] = []
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


class RewardConfig(_Section):
    """How samples are scored (see :mod:`asyncrl.rewards`)."""

    function: str | None = None
    """module:function or path.py:function; empty: chosen by each row's data_source."""
    timeout_s: Float = Field(10.0, gt=0, le=DAY_S)
    """A sample whose reward takes longer scores 0, tagged `error:timeout`."""
    workers: StrictInt = Field(1, ge=1, le=MAX_PROCESSES)
    """Scoring processes per generator replica."""
    memory_limit_mb: StrictInt = Field(4096, ge=64, le=1_048_576)
    """Address-space limit of each reward worker process, in MiB."""
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
        if value is not None and _spec_parts(value) is None:
            raise ValueError(f"expected module:function or path/to/file.py:function, got {value!r}")
        return value

    @model_validator(mode="after")
    def _range(self) -> RewardConfig:
        if self.min > self.max:
            raise ValueError(f"reward.min={self.min} is above reward.max={self.max}")
        return self


class AlgorithmConfig(_Section):
    group_size: StrictInt = Field(8, ge=1, le=4096)
    """Samples generated per prompt (one group; GRPO normalises within it)."""
    prompts_per_step: StrictInt = Field(8, ge=1, le=65536)
    """Groups in one learner batch."""
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = "grpo"
    """Advantage estimator; `gae` is PPO with a critic (value head), the others need none."""
    normalize_std: bool = True
    """GRPO: divide by the group's reward std (off gives Dr. GRPO's advantage)."""
    clip_low: Float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip below: the ratio pi_theta/pi_prox is clipped at 1 - clip_low."""
    clip_high: Float = Field(0.2, ge=0.0)
    """PPO clip above: clipped at 1 + clip_high (DAPO's clip-higher raises it)."""
    clip_c: Float | None = Field(None, gt=1.0)
    """Dual clip: for negative advantages the loss is at most -clip_c * A; empty disables."""
    correction: Literal["none", "tis", "mis", "decoupled"] = "tis"
    """Behavior correction w(rho = pi_prox/pi_behavior): tis min(rho, C), mis 0 above C, none 1."""
    correction_level: Literal["token", "sequence"] = "token"
    """Ratio per token, or per sequence (the geometric mean of its token ratios)."""
    correction_cap: Float = Field(2.0, gt=0.0)
    """C, the truncation (tis) or masking (mis) threshold of the behavior importance weight."""
    aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number; `seq-mean-token-sum-norm` is Dr. GRPO's."""
    gamma: Float = Field(1.0, ge=0.0, le=1.0)
    """Discount over response tokens (reinforce_pp, gae)."""
    lam: Float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda (gae only)."""
    value_clip: Float | None = Field(0.2, gt=0.0)
    """gae: clip the value head's change per update to +-value_clip; empty disables."""
    value_coef: Float = Field(0.5, ge=0.0)
    """gae: weight of the value loss added to the policy loss."""
    kl_coef: Float = Field(0.0, ge=0.0)
    """Weight of the KL to a frozen reference model; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman): k1 log-ratio, k2 half its square, k3 non-negative."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: added to the loss, or subtracted from each token's reward."""
    entropy_coef: Float = Field(0.0, ge=0.0)
    """Entropy bonus: subtract entropy_coef * entropy from the loss; 0 disables."""

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.prompts_per_step


class BufferConfig(_Section):
    max_staleness: StrictInt = Field(1, ge=0, le=10_000)
    """k: never train on a trajectory produced more than k versions ago."""
    admission_control: bool = True
    """Hand out prompts only while started samples fit in (V+k+1)*samples_per_step."""
    heartbeat_interval_s: Float = Field(1.0, gt=0.0, le=3600.0)
    """Generators tell the buffer they are alive at least this often."""
    heartbeat_timeout_s: Float = Field(10.0, gt=0.0, le=DAY_S)
    """A generator silent this long is presumed dead: its unfinished groups are requeued."""
    max_reuse: StrictInt = Field(1, ge=1, le=10_000)
    """Serve each sample to the learner at most this many times (while fresh enough)."""
    filter_equal_rewards: bool = False
    """Drop complete groups whose rewards are all equal (DAPO dynamic sampling)."""
    filter_truncated: bool = False
    """Drop a whole group if any of its samples ends with finish_reason `length`."""
    max_held_samples: StrictInt = Field(0, ge=0)
    """Back-pressure: refuse new work while this many samples are ready; 0 means 4 batches."""
    max_held_bytes: StrictInt = Field(256 * 1024 * 1024, ge=1, le=1 << 50)
    """Back-pressure: refuse new work while held samples take this many bytes."""
    stale_retries: StrictInt = Field(2, ge=0, le=100)
    """Times a prompt whose group was evicted as stale is handed out again before its id
    is recorded as skipped."""


class LearnerConfig(_Section):
    lr: Float = Field(1e-3, gt=0.0, le=1.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up, keep the rate, or decay it to `min_lr_ratio * lr` at the last step."""
    warmup_steps: StrictInt = Field(0, ge=0)
    """Steps of linear warm-up from 0 to `lr`."""
    min_lr_ratio: Float = Field(0.0, ge=0.0, le=1.0)
    weight_decay: Float = Field(0.0, ge=0.0)
    grad_clip: Float = Field(1.0, gt=0.0)
    """Clip gradients to this global L2 norm (over all shards)."""
    sync_interval: StrictInt = Field(1, ge=1)
    """Publish weights every this many versions."""
    world_size: StrictInt = Field(1, ge=1, le=MAX_PROCESSES)
    """Learner ranks (processes); the policy is sharded over them with FSDP2."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: CUDA (NCCL) when a GPU is visible, else CPU (gloo)."""
    mixed_precision: Literal["auto", "bf16", "none"] = "auto"
    """`bf16`: bf16 parameters in compute, fp32 gradient reduction. `auto`: bf16 on CUDA only."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass: less memory, more compute."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only)."""
    max_tokens_per_microbatch: StrictInt = Field(16384, ge=1, le=1 << 30)
    """Token budget of one forward/backward (rows x padded length); gradients accumulate."""
    minibatches: StrictInt = Field(1, ge=1)
    """Optimizer updates per batch. Above 1 the proximal policy costs one extra forward pass."""
    checkpoint_every: StrictInt = Field(0, ge=0)
    """Save a sharded checkpoint every this many steps (0: only the final policy)."""
    keep_checkpoints: StrictInt | None = Field(None, ge=1)
    """Keep only the newest this many complete checkpoints; empty: keep them all."""
    stop_timeout_s: Float = Field(8.0, gt=0.0, le=DAY_S)
    """On a stop, the learner is killed unless it has saved its final checkpoint and exited
    this long after the generators' 4 s share; raise it for models that save slowly."""
    num_threads: StrictInt = Field(1, ge=1, le=MAX_PROCESSES)
    """torch intra-op threads per learner rank."""
    num_cpus_per_rank: Float = Field(1.0, gt=0.0)
    """CPUs each rank asks for (Ray resources)."""
    num_gpus_per_rank: Float = Field(0.0, ge=0.0, le=1.0)
    """GPUs each rank asks for (Ray resources; Ray hides GPUs from a rank that asks for none)."""
    placement: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """Ray placement group strategy of the ranks; STRICT_PACK: all on one node."""
    resources: dict[str, Float] = {}
    """Custom Ray resources each rank asks for, e.g. `{learner_node: 1}` offered only by
    the nodes meant for the learner (`ray start --resources`)."""


class GeneratorsConfig(_Section):
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
    stop: list[str] = []
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
    pools: list[PoolConfig] = []
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


class PoolConfig(_Section):
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


class TrackingConfig(_Section):
    aim: bool = True
    """Track metrics in an aim repo inside the run directory (false: metrics.jsonl only)."""
    generations_per_step: StrictInt = Field(2, ge=0, le=1000)
    """Sampled generations (prompt, response, reward) sent to aim as text each step."""


class ClusterConfig(_Section):
    """Where the endpoints listen and how peers reach them (see docs/security.md)."""

    backend: Literal["local", "ray"] = "local"
    """`local`: one process per role on this machine; `ray`: each role a Ray actor placed by
    the resources it asks for (docs/ray.md)."""
    address: str | None = None
    """ray: the cluster to join (`auto`, `HOST:6379`); empty: a local Ray on 127.0.0.1."""
    buffer_num_cpus: Float = Field(1.0, ge=0.0)
    """ray: CPUs the buffer asks for; it is placed beside learner rank 0."""
    host: str = "127.0.0.1"
    """Address the roles connect to: the buffer's and learner's machine as the others reach it."""
    bind: str | None = None
    """Interface the buffer and weights endpoints listen on (`0.0.0.0`: all); empty: `host`.
    Anything but loopback needs CURVE keys: `asyncrl keys RUN_DIR`."""
    buffer_port: StrictInt = Field(0, ge=0, le=65535)
    """0 picks a free port at launch."""
    weights_port: StrictInt = Field(0, ge=0, le=65535)
    curve: bool | Literal["auto"] = "auto"
    """Encrypt and authenticate every connection with ZeroMQ CURVE; `auto`: when `bind`
    is not loopback (it cannot be turned off there)."""
    keys_dir: str | None = None
    """Folder of the run's credentials: the per-run secret the launcher writes (loopback), or
    the CURVE keys `asyncrl keys DIR` writes into DIR/keys; empty: RUN_DIR/keys."""
    auth: bool = True
    """Every peer proves it belongs to the run (loopback: a per-run secret; beyond: CURVE)
    and is served only its role's requests. false: any local process may feed the learner
    and read the weights (trusted single-user machines only; it cannot be turned off
    beyond loopback)."""

    @property
    def bind_address(self) -> str:
        return self.bind or self.host

    @property
    def binds_loopback(self) -> bool:
        """True when only this machine can reach the endpoints; a host name counts as not."""
        import ipaddress

        address = self.bind_address.strip("[]")
        if address == "localhost":
            return True
        try:
            return ipaddress.ip_address(address).is_loopback
        except ValueError:  # a host name or `*`: it may be reachable from anywhere
            return False

    @property
    def uses_curve(self) -> bool:
        return self.curve is True or not self.binds_loopback

    @model_validator(mode="after")
    def _curve_beyond_loopback(self) -> ClusterConfig:
        if not self.auth and self.uses_curve:
            raise ValueError(
                f"cluster.auth=false with cluster.bind={self.bind_address}"
                f"{' and cluster.curve=true' if self.curve is True else ''}: CURVE "
                "authenticates every peer; drop cluster.auth, or bind to 127.0.0.1 without curve"
            )
        if self.curve is False and not self.binds_loopback:
            raise ValueError(
                f"cluster.curve=false with cluster.bind={self.bind_address}: an endpoint "
                "other machines can reach must use CURVE keys; drop cluster.curve (auto) "
                "and run `asyncrl keys RUN_DIR`, or bind to 127.0.0.1"
            )
        return self


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig
    task: TaskConfig = TaskConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    buffer: BufferConfig = BufferConfig()
    learner: LearnerConfig = LearnerConfig()
    generators: GeneratorsConfig = GeneratorsConfig()
    tracking: TrackingConfig = TrackingConfig()
    cluster: ClusterConfig = ClusterConfig()
    environment: EnvironmentConfig | None = None
    """Multi-turn episodes (tool calling); unset: one model turn per sample."""

    @model_validator(mode="after")
    def _weights_fresh_enough(self) -> Config:
        k = self.buffer.max_staleness
        if self.learner.sync_interval > k + 1:
            raise ValueError(
                f"learner.sync_interval={self.learner.sync_interval} must be at most "
                f"buffer.max_staleness + 1 = {k + 1}: generators would only hold weights "
                "too stale to train on; raise buffer.max_staleness or lower learner.sync_interval"
            )
        return self

    @model_validator(mode="after")
    def _minibatches_fit(self) -> Config:
        if self.learner.minibatches > self.algorithm.samples_per_step:
            raise ValueError(
                f"learner.minibatches={self.learner.minibatches} is more than the "
                f"{self.algorithm.samples_per_step} samples of a batch "
                "(algorithm.group_size * algorithm.prompts_per_step)"
            )
        return self

    @model_validator(mode="after")
    def _eval_can_run(self) -> Config:
        evaluation = self.eval
        if not evaluation.enabled:
            return self
        if evaluation.every_steps % self.learner.sync_interval:
            raise ValueError(
                f"eval.every_steps={evaluation.every_steps} must be a multiple of "
                f"learner.sync_interval={self.learner.sync_interval}: a round evaluates "
                "weights the generators have, and only every sync_interval-th version is published"
            )
        if self.data.train_files and not evaluation.files:
            raise ValueError(
                "eval.files is empty but data.train_files is set: name held-out prompt files "
                "(e.g. the test split) in eval.files; the built-in task's prompts would not "
                "measure this run"
            )
        if not evaluation.files:
            space = 10**self.task.num_digits
            if evaluation.max_prompts > space // 2:
                raise ValueError(
                    f"eval.max_prompts={evaluation.max_prompts} is more than half of the "
                    f"{space} prompts of task.num_digits={self.task.num_digits}: training "
                    "never draws eval prompts, so it would have too few left; lower "
                    "eval.max_prompts or raise task.num_digits"
                )
        for pool in self.generators.resolved_pools():
            if evaluation.samples_per_prompt > pool.settings.max_active_samples:
                raise ValueError(
                    f"eval.samples_per_prompt={evaluation.samples_per_prompt} is more than "
                    f"generators.max_active_samples={pool.settings.max_active_samples} (pool "
                    f"{pool.name!r}): an eval prompt's samples go to one replica together"
                )
        return self


class ConfigError(ValueError):
    """Invalid configuration; ``str()`` gives one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = [_one_line(problem) for problem in problems]
        super().__init__("\n".join(self.problems))


def _one_line(text: str) -> str:
    """A problem is one line of plain text, whatever a key or value in it holds."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _directory_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one directory's name, or None."""
    if not name.strip():
        return "must not be empty: it names the run's directory"
    if "/" in name or "\\" in name or os.sep in name:
        return f"{name!r} holds a path separator: it names one directory, inside run.output_dir"
    if ".." in name:
        return f"{name!r} holds '..': it names one directory, inside run.output_dir"
    if any(ord(character) < 32 or ord(character) == 127 for character in name):
        return f"{name!r} holds a control character (NUL, newline, ...): it names a directory"
    if len(name) > 100:
        return f"is {len(name)} characters long; at most 100 (it names a directory)"
    return None


def _spec_parts(spec: str) -> tuple[str, str] | None:
    """``(where, name)`` of a `module:name` or `path/to/file.py:name` spec, or None."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        return None
    return where, name


def _spec_file(spec: str) -> Path | None:
    """The file a `path/to/file.py:name` spec names (as the loaders read it), or None for a
    module spec; see :func:`asyncrl.rewards.load_reward_function`."""
    parts = _spec_parts(spec)
    if parts is None:
        return None
    where = parts[0]
    if where.endswith(".py") or "/" in where or "\\" in where or os.sep in where:
        return Path(where).expanduser()
    return None


# --------------------------------------------------------------------------
# loading


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read YAML at ``path`` (optional), apply ``key.path=value`` overrides, validate."""
    raw: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    problems: list[str] = []
    if path is not None:
        raw, origins = _read_yaml(Path(path))
    for override in overrides or []:
        try:
            keys, value = _parse_override(override)
        except ValueError as error:
            problems.append(str(error))
            continue
        _set_path(raw, keys, value)
        label = f"override '{_shorten(override)}'"
        for key in [k for k in origins if k[: len(keys)] == keys]:
            del origins[key]  # replaced by the override: file lines no longer apply
        for end in range(1, len(keys)):
            origins.setdefault(keys[:end], label)
        origins[keys] = label
    if problems:
        raise ConfigError(problems)
    try:
        config = Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError([_describe(e, origins) for e in error.errors()]) from None
    problems = _missing_files(config, origins)
    if problems:
        raise ConfigError(problems)
    return config


def config_from_dict(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError([_describe(e, {}) for e in error.errors()]) from None


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def _missing_files(config: Config, origins: dict[tuple[str, ...], str]) -> list[str]:
    """Plug-ins named by file (`path/to/file.py:name`) whose file is not there. Checked when a
    config is loaded for a launch or `validate`, not by the schema: a run's saved config is
    read again from other directories and machines, where relative paths mean other files."""
    specs: list[tuple[tuple[str, ...], str]] = []
    if config.reward.function is not None:
        specs.append((("reward", "function"), config.reward.function))
    environment = config.environment
    if environment is not None:
        specs.append((("environment", "name"), environment.name))
        specs += [(("environment", "tools", str(i)), t) for i, t in enumerate(environment.tools)]
    problems = []
    for loc, spec in specs:
        file = _spec_file(spec)
        if file is not None and not file.is_file():
            where = _origin(loc, origins)
            problems.append(
                f"{where}: {'.'.join(loc)}: no such file {str(file)!r} (from {spec!r}; "
                f"relative paths are read from {os.getcwd()})"
            )
    return problems


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    try:
        raw, lines = read_yaml_file(path)
    except YamlFileError as error:
        raise ConfigError([str(error)]) from None
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: expected a mapping of sections at the top level"])
    return raw, {keys: f"{path}:{line}" for keys, line in lines.items()}


def _parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(
            f"override '{_shorten(text)}': expected key.path=value, e.g. buffer.max_staleness=2"
        )
    if len(value.encode(errors="replace")) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"override '{_shorten(text)}': the value is over {MAX_CONFIG_BYTES // 1024} KiB"
        )
    try:
        parsed = parse_yaml(value)[0] if value else ""
    except YamlRefused as error:
        raise ValueError(f"override '{_shorten(text)}': {error.problem}") from None
    except yaml.YAMLError:
        parsed = value  # not YAML: the text itself, e.g. a string holding ': '
    return tuple(key.split(".")), parsed


def _shorten(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _set_path(raw: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value


# --------------------------------------------------------------------------
# error messages


def _describe(error: dict[str, Any], origins: dict[tuple[str, ...], str]) -> str:
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(loc) or "(top level)"
    where = _origin(loc, origins)
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key '{key}'{_suggestion(loc)}"
    if error["type"] == "missing":
        return f"{where}: missing required key '{key}'"
    message = error["msg"].removeprefix("Value error, ")
    if "input" in error and error["type"] != "value_error" and not isinstance(error["input"], dict):
        message += f", got {_shorten(repr(error['input']), 80)}"
    return f"{where}: {key}: {message}"


def _origin(loc: tuple[str, ...], origins: dict[tuple[str, ...], str]) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in origins:
            return origins[loc[:end]]
    return "config"


def _suggestion(loc: tuple[str, ...]) -> str:
    """Closest valid key: in the same section, else any key with a similar leaf name."""
    section = _model_at(loc[:-1])
    if section is not None:
        close = difflib.get_close_matches(loc[-1], list(section.model_fields), n=1, cutoff=0.6)
        if close:
            return f"; did you mean '{'.'.join((*loc[:-1], close[0]))}'?"
    leaves = {path[-1]: path for path in _all_paths(Config)}
    close = difflib.get_close_matches(loc[-1], list(leaves), n=1, cutoff=0.75)
    if close:
        return f"; did you mean '{'.'.join(leaves[close[0]])}'?"
    if section is not None:
        return f"; valid keys here: {', '.join(section.model_fields)}"
    return ""


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        sub = _section_type(field.annotation)
        if sub is None:
            return None
        model = sub
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _all_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        paths += _all_paths(sub, (*prefix, name)) if sub else [(*prefix, name)]
    return paths


# --------------------------------------------------------------------------
# warnings


def config_warnings(config: Config) -> list[str]:
    """Valid but risky settings, one human-readable line each, to print at launch."""
    warnings: list[str] = []
    algorithm, buffer = config.algorithm, config.buffer
    if algorithm.correction == "none" and buffer.max_staleness > 0:
        warnings.append(
            f"algorithm.correction=none with buffer.max_staleness={buffer.max_staleness}: "
            "tokens sampled by older policies are trained as if on-policy, so the clipped "
            "ratio no longer bounds the update; uncorrected off-policy PPO has collapsed "
            "silently in other trainers. Use algorithm.correction=tis (the default), or "
            "buffer.max_staleness=0"
        )
    return warnings
