"""LoRA adapters on the policy, made by peft: wrap it, publish the adapters alone (or fold
them into the base weights as they stream out), and write them in peft's own format.

The learner trains ``base_model.model.<name>`` wrapped by peft. With ``publish: adapter``
each sync moves the adapters alone, under the names peft saves them by
(``<layer>.lora_A.weight``, ``<layer>.lora_B.weight``), and every engine applies them on
its own copy of the base (:func:`inject_adapters`). With ``publish: merged`` generators
see plain Hugging Face names: each adapted linear layer's ``weight`` comes out as
``W + (alpha / r) * B @ A``, computed in fp32.

An adapter is known by its digest (:func:`adapter_digest`): the learner announces the
digest of every version it publishes, each replica reports the digest of the adapter its
engine holds, and the buffer refuses samples whose versions' digests differ.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from asyncrl.config import LoraConfig, ModelConfig
from asyncrl.core.messages import BASE_DIGEST

PEFT_PREFIX = "base_model.model."
"""What peft puts before every Hugging Face name of the model it wraps."""
ADAPTER_DIR = "adapter"
"""The final export's sub-folder holding the adapter alone (peft's format)."""
_BASE, _A, _B = ".base_layer.", ".lora_A.", ".lora_B."
ADAPTER_NAME = "default"
"""The name peft gives the one adapter (``<layer>.lora_A.default.weight``)."""


class LoraUnavailable(ImportError):
    """``model.lora`` is set but peft is not installed."""

    advice = "needs peft, not installed here: pip install 'asyncrl[lora]'"


def peft_config(config: LoraConfig):
    """peft's ``LoraConfig`` for ``model.lora``."""
    try:
        import peft
    except ImportError as error:
        raise LoraUnavailable(f"model.lora {LoraUnavailable.advice}") from error
    return peft.LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=config.target_modules,
        bias="none",
    )


def with_adapters(model: nn.Module, config: LoraConfig, seed: int) -> nn.Module:
    """``model`` wrapped by peft with fresh adapters (B = 0: it computes what ``model``
    did), only the adapters trainable. Seeded, so every rank draws the same A."""
    settings = peft_config(config)  # first: it says what to install when peft is not
    import peft

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, settings)
    not_linear = sorted(
        name
        for name, module in wrapped.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer)
        and not isinstance(module, peft.tuners.lora.Linear)
    )
    if not_linear:
        raise ValueError(
            f"model.lora.target_modules: {', '.join(not_linear[:5])} are not linear layers; "
            "adapters go on linear layers only here (their weights are folded in on publish)"
        )
    if not any(isinstance(m, peft.tuners.lora.Linear) for m in wrapped.modules()):
        raise ValueError(f"model.lora.target_modules: {config.target_modules} matched no layer")
    return wrapped


def scaling(config: LoraConfig) -> float:
    return config.alpha / config.rank


def merged_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], config: LoraConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (peft's names, prefix stripped) as the plain model's: each adapted
    layer's base weight and adapters become its one ``weight``, emitted once all three
    have passed; everything else goes through as it comes."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        part = next((p for p in (_BASE, _A, _B) if p in name), None)
        if part is None:
            yield name, tensor
            continue
        layer, rest = name.split(part, 1)
        if part == _BASE and not rest.startswith("weight"):
            yield f"{layer}.{rest}", tensor  # the base layer's bias: unchanged
            continue
        pieces = held.setdefault(layer, {})
        pieces[part] = tensor
        if len(pieces) == 3:
            del held[layer]
            yield f"{layer}.weight", merge(pieces[_BASE], pieces[_A], pieces[_B], config)
    if held:
        raise ValueError(f"adapted layers missing a part in the stream: {sorted(held)[:5]}")


def merge(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, config: LoraConfig
) -> torch.Tensor:
    """``W + (alpha / r) * B @ A`` in fp32, back in ``W``'s dtype."""
    delta = b.float() @ a.float()
    return (weight.float() + scaling(config) * delta).to(weight.dtype)


def is_adapter(name: str) -> bool:
    return _A in name or _B in name


def save_adapter(
    state: dict[str, torch.Tensor], model: nn.Module, config: ModelConfig, output: Path
) -> None:
    """Write the adapter of ``state`` (the wrapped model's full state dict, peft's names
    without :data:`PEFT_PREFIX`) to ``output`` as peft saves one, with its base named.

    ``model`` is a plain model of the same architecture (its weights are not saved);
    peft wraps it in place, so it is of no other use afterwards."""
    import peft

    assert config.lora is not None
    wrapped = peft.get_peft_model(model, peft_config(config.lora))
    adapters = {f"{PEFT_PREFIX}{name}": t for name, t in state.items() if is_adapter(name)}
    missing, unexpected = wrapped.load_state_dict(adapters, strict=False)
    if unexpected or any(is_adapter(name) for name in missing):
        raise ValueError(f"the adapter does not fit its model: {unexpected[:3] or missing[:3]}")
    wrapped.peft_config["default"].base_model_name_or_path = config.name_or_path
    wrapped.save_pretrained(output)


def published_name(name: str) -> str:
    """peft's name of an adapter tensor in a live model as peft saves it: the adapter's
    name dropped (``<layer>.lora_A.default.weight`` -> ``<layer>.lora_A.weight``)."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def adapter_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """What identifies an adapter's values: a BLAKE2b hash of every tensor's name, dtype,
    shape and bytes, in name order (the order tensors arrive in does not matter), or
    :data:`BASE_DIGEST` when every ``lora_B`` is zero (the adapter is then the base model,
    whatever its ``A``)."""
    named = sorted(tensors, key=lambda item: item[0])
    if all(not bool(t.any()) for name, t in named if _B in name):
        return BASE_DIGEST
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in named:
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


class AdapterWeights:
    """A model's live adapter tensors under their published names: what a weight path
    loads into when only adapters are synced (``state_dict`` as a module's: the tensors
    themselves with ``keep_vars``, detached views otherwise)."""

    def __init__(self, model: nn.Module):
        self.parameters = {
            published_name(name): parameter
            for name, parameter in model.named_parameters()
            if is_adapter(name)
        }
        if not self.parameters:
            raise ValueError("the model holds no LoRA adapters")

    def state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        if keep_vars:
            return dict(self.parameters)
        return {name: p.detach() for name, p in self.parameters.items()}

    def digest(self) -> str:
        return adapter_digest(self.state_dict().items())


def inject_adapters(model: nn.Module, config: LoraConfig) -> AdapterWeights:
    """Give ``model`` (an engine's copy of the base, in place) LoRA layers where the learner
    has them, all zero: it computes the base until a version's adapters are loaded."""
    import peft

    peft.inject_adapter_in_model(peft_config(config), model, adapter_name=ADAPTER_NAME)
    adapters = AdapterWeights(model)
    with torch.no_grad():
        for parameter in adapters.parameters.values():
            parameter.zero_()
            parameter.requires_grad_(False)
    return adapters


def adapter_config_json(config: LoraConfig, names: Iterable[str], base: str) -> dict:
    """peft's ``adapter_config.json`` for adapters named ``names`` (published names): the
    layers they adapt listed by their last name part, as peft writes them."""
    layers = sorted({name.split(_A)[0].split(_B)[0].rsplit(".", 1)[-1] for name in names})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": layers,
        "base_model_name_or_path": base,
    }


def peft_file_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published adapter tensors under the names of peft's ``adapter_model.safetensors``."""
    return {f"{PEFT_PREFIX}{name}": tensor for name, tensor in tensors.items()}
