"""KL's reference policy: a frozen, sharded copy of the initial model, or, with LoRA, the
policy itself with its adapters switched off, which is the base model without a second
copy of its weights in memory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import nn

from asyncrl.config import Config
from asyncrl.generation.models import build_policy
from asyncrl.learner import sharding
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.packing import ModelInput, token_outputs


class Reference:
    """Log-probs of the reference policy on a micro-batch's inputs."""

    def __init__(
        self,
        model: nn.Module,
        adapters_off: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ):
        self.model = model
        self.adapters_off = adapters_off

    @classmethod
    def for_policy(cls, policy: nn.Module, config: Config, ranks: Ranks) -> Reference:
        """With LoRA, ``policy`` (the trained, sharded model) with its adapters off;
        without, a frozen copy of the initial model, sharded like the policy."""
        if config.model.lora is not None:
            return cls(policy, sharding.language_model(policy).disable_adapter)
        reference, _ = build_policy(config.model, config.run.seed)
        reference.requires_grad_(False)
        return cls(sharding.shard(reference, config.learner, ranks))

    def logprobs(self, inputs: ModelInput, temperature: float) -> torch.Tensor:
        with torch.no_grad(), self.adapters_off():
            return token_outputs(self.model, inputs, temperature, entropy="none").logprobs
