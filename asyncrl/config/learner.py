"""The learner: optimizer, schedule, sharding, micro-batches, checkpoints, resources."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt

from asyncrl.config.base import MAX_PROCESSES, Section
from asyncrl.config.environment import DAY_S, Float


class LearnerConfig(Section):
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
    pack_sequences: Literal["auto"] | bool = "auto"
    """Run a micro-batch's samples as packed sequences without padding, the samples of a
    group sharing one pass over their prompt (learner/packing.py). `auto`: when the model
    computes the same log-probs that way (checked at start), else padded rows; `true`:
    stop at start if it does not; `false`: always padded rows."""
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
    resources: dict[str, Float] = Field(default_factory=dict)
    """Custom Ray resources each rank asks for, e.g. `{learner_node: 1}` offered only by
    the nodes meant for the learner (`ray start --resources`)."""
