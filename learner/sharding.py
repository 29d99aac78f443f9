"""Build the trainable model and shard it with FSDP2.

``fully_shard`` goes on every transformer block (the classes a Hugging Face
model lists in ``_no_split_modules``) and then on the root, which holds the
embeddings, final norm, LM head and, for PPO, the value head. Each block's
parameters are gathered just before it runs and freed after, so peak memory
is one block's full weights plus the shards.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from asyncrl.config import LearnerConfig
from asyncrl.learner.distributed import Ranks


class PolicyWithValueHead(nn.Module):
    """The causal LM plus a linear value head on its last hidden state (PPO's critic).

    Sharing the trunk halves the memory of a separate critic; the value loss
    is weighted by ``algorithm.value_coef``. Only ``policy.*`` is published to
    generators.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids=None):
        out = self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
        )
        hidden = out.hidden_states[-1]
        return out.logits, self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


def language_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside ``model`` (itself, or the policy under a value head)."""
    return model.policy if isinstance(model, PolicyWithValueHead) else model


def forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """``(logits, values or None)`` for either kind of model."""
    if isinstance(model, PolicyWithValueHead):
        return model(input_ids, attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask).logits, None


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(language_model(model), "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(language_model(model)).__name__} names no transformer block class in "
            "_no_split_modules; cannot shard it per block"
        )
    return blocks


def mixed_precision(config: LearnerConfig, device: torch.device) -> MixedPrecisionPolicy | None:
    if config.mixed_precision == "bf16" or (
        config.mixed_precision == "auto" and device.type == "cuda"
    ):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard(model: nn.Module, config: LearnerConfig, ranks: Ranks) -> nn.Module:
    """Apply FSDP2 in place: each block, then the root. Returns ``model``."""
    if config.activation_checkpointing:
        language_model(model).gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    if config.cpu_offload and ranks.device.type != "cuda":
        raise ValueError("learner.cpu_offload needs learner.device=cuda: on CPU it is a no-op")
    mesh = init_device_mesh(ranks.device.type, (ranks.world_size,))
    options: dict = {"mesh": mesh}
    if (policy := mixed_precision(config, ranks.device)) is not None:
        options["mp_policy"] = policy
    if config.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    else:
        model.to(ranks.device)
    for block in transformer_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def full_tensors(
    model: nn.Module,
    prefix: str = "",
    skip: Collection[str] = (),
    keep: Callable[[str], bool] | None = None,
):
    """Yield ``(name, full CPU tensor)`` per entry of the state dict, one at a time,
    but those named in ``skip`` or (with ``keep``) whose name it turns down.

    A collective: every rank must drain the iterator in the same order; each
    gets the full tensors. Names are the Hugging Face ones (``prefix``
    stripped), which is what generators load.
    """
    for name, tensor in model.state_dict().items():
        if not name.startswith(prefix) or name[len(prefix) :] in skip:
            continue
        if keep is not None and not keep(name[len(prefix) :]):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        yield name[len(prefix) :], full.detach().cpu()
