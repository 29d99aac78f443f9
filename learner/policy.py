"""The policy being trained, on every rank: its FSDP2 shards, optimizer, learning-rate
schedule and update rule, and its version (the number of batches trained on).

No sockets: the loop (:mod:`.trainer`) feeds it batches, and tests drive it alone.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from asyncrl.config import Config
from asyncrl.generation import lora
from asyncrl.generation.models import DTYPES, build_policy, empty_like, tied_names
from asyncrl.learner import checkpoint, sharding
from asyncrl.learner.algorithms import needs_of
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.reference import Reference
from asyncrl.learner.update import Update


def lr_multiplier(config: Config):
    """The schedule as a function of the step: linear warm-up, then constant or a decay."""
    learner, total = config.learner, config.run.total_steps

    def multiplier(step: int) -> float:
        if step < learner.warmup_steps:
            return (step + 1) / learner.warmup_steps
        if learner.lr_schedule == "constant":
            return 1.0
        progress = (step - learner.warmup_steps) / max(1, total - learner.warmup_steps)
        progress = min(progress, 1.0)
        decay = (
            1 - progress
            if learner.lr_schedule == "linear"
            else 0.5 * (1 + math.cos(math.pi * progress))
        )
        return learner.min_lr_ratio + (1 - learner.min_lr_ratio) * decay

    return multiplier


class Learner:
    """Sharded model, optimizer, schedule and update rule, without sockets (tests drive it)."""

    def __init__(self, config: Config, ranks: Ranks):
        self.config = config
        self.ranks = ranks
        needs = needs_of(config.algorithm)
        policy, self.tokenizer = build_policy(config.model, config.run.seed)
        self.policy_config = policy.config
        tied = tied_names(policy)
        self.tied_head = {tied[1]} if tied else set()
        """An LM head tied to the embedding: published once, as the embedding (every
        engine ties it back), so each sync moves its bytes once, not twice."""
        self.lora = config.model.lora
        self.publishes_adapters = config.model.publishes_adapters
        if self.lora is not None:
            policy = lora.with_adapters(policy, self.lora, config.run.seed)
        model: nn.Module = policy
        if needs.values:
            with torch.random.fork_rng():
                model = sharding.PolicyWithValueHead(policy)
        self.model = sharding.shard(model, config.learner, ranks)
        self.publish_prefix = ("policy." if needs.values else "") + (
            lora.PEFT_PREFIX if self.lora is not None else ""
        )
        self.reference = None
        if needs.reference:
            self.reference = Reference.for_policy(self.model, config, ranks)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: the adapters
            lr=config.learner.lr,
            weight_decay=config.learner.weight_decay,
            fused=True,  # one kernel over every tensor: on CPU the default loops per tensor
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(config))
        self.update = Update(self.model, self.optimizer, config, ranks, self.reference)
        self.version = 0
        """The policy's version: the batches trained on (steps), resumed ones included."""
        self.checkpoints_refused = 0
        """Checkpoints not written because the weights or optimizer state were not finite."""

    def proximal_logprobs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The no-grad pass over ``batch`` before it trains the policy: proximal log-probs
        and what else the update needs of the weights before they change
        (:meth:`.Update.proximal_logprobs`)."""
        self.model.train()
        return self.update.proximal_logprobs(batch)

    def train_step(
        self, batch: TrainBatch, proximal: dict[str, torch.Tensor] | None = None
    ) -> dict[str, float]:
        """Train on ``batch``, given its :meth:`proximal_logprobs` (computed here when not
        given); the version moves on by one, even when a non-finite update was skipped."""
        if proximal is None:
            proximal = self.proximal_logprobs(batch)
        self.model.train()
        metrics = self.update.step(batch, proximal, self.version)
        metrics["learner_lr"] = self.scheduler.get_last_lr()[0]
        metrics["learner_checkpoints_refused_total"] = float(self.checkpoints_refused)
        self.scheduler.step()
        self.version += 1
        return metrics

    def full_tensors(self):
        """The policy's full tensors by their Hugging Face names, one at a time, LoRA
        adapters folded into their layers' weights (a collective: every rank drains it)."""
        return self._plain(sharding.full_tensors(self.model, self.publish_prefix))

    def published_tensors(self):
        """:meth:`full_tensors` as the generators get them: a tied LM head left out; with
        ``model.lora.publish: adapter``, the adapters alone under peft's saved names."""
        if self.publishes_adapters:
            adapters = sharding.full_tensors(self.model, self.publish_prefix, keep=lora.is_adapter)
            return ((lora.published_name(name), tensor) for name, tensor in adapters)
        tensors = sharding.full_tensors(self.model, self.publish_prefix, skip=self.tied_head)
        return self._plain(tensors)

    def _plain(self, tensors):
        return tensors if self.lora is None else lora.merged_tensors(tensors, self.lora)

    def save_checkpoint(self, path: Path) -> bool:
        """Write this rank's part; False (on every rank) if refused as not finite."""
        state = {
            "step": self.version,  # trainer.json's name for it
            "scheduler": self.scheduler.state_dict(),
            "skipped_nonfinite_total": self.update.skipped_nonfinite,
            "kl_controller": self.update.kl_control.state_dict(),
        }
        saved = checkpoint.save(path, self.model, self.optimizer, state, self.ranks.rank)
        if not saved:
            self.checkpoints_refused += 1
        return saved

    def load_checkpoint(self, path: Path) -> None:
        state = checkpoint.load(path, self.model, self.optimizer, self.ranks.rank)
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = state["step"]
        self.update.skipped_nonfinite = state.get("skipped_nonfinite_total", 0)
        if "kl_controller" in state:  # absent from checkpoints before the adaptive controller
            self.update.kl_control.load_state_dict(state["kl_controller"])

    def save_pretrained(self, path: Path) -> None:
        """The policy in Hugging Face format, LoRA adapters folded in, and with LoRA the
        adapter alone in ``path/adapter`` (peft's format); rank 0 writes, every rank
        must call."""
        state = dict(sharding.full_tensors(self.model, self.publish_prefix))
        if self.ranks.is_main:
            policy = empty_like(self.policy_config, DTYPES[self.config.model.dtype])
            policy.load_state_dict(dict(self._plain(state.items())))
            try:
                policy.save_pretrained(path)
                self.tokenizer.save_pretrained(path)
                if self.lora is not None:  # last: peft wraps ``policy`` in place
                    adapter = path / lora.ADAPTER_DIR
                    lora.save_adapter(state, policy, self.config.model, adapter)
            except OSError as error:
                raise checkpoint.CheckpointWriteError(path, error, "the final policy") from error
