"""What a vLLM engine loads from outside it, and how: the model folder it starts on, the
worker extension that reloads weights in place, where weight files pass to a worker in
another process, and LoRA adapters as vLLM takes them (a peft folder, a rank it accepts).

Kept apart from :mod:`asyncrl.generators.vllm_backend` (the engine and its chunks) because
vLLM's worker processes import the extension (through
:mod:`asyncrl.generators.vllm_weight_sync`) and need nothing of the engine's side.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from asyncrl.config import LoraConfig
from asyncrl.generation import lora


class WeightLoaderExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): in-place weight reloads."""

    def asyncrl_load_tensors(self, weights: dict[str, torch.Tensor]) -> int:
        """Load ``weights`` (HF names) into the running model; returns how many were given."""
        # the worker's own reload: layer-wise weight loading plus re-processing
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        return len(weights)

    def asyncrl_load_file(self, path: str) -> int:
        """Load the safetensors file at ``path`` (the worker runs in another process)."""
        from safetensors.torch import load_file

        return self.asyncrl_load_tensors(load_file(path))


def export_model(model: torch.nn.Module, tokenizer, directory: Path) -> Path:
    """Write ``model`` and ``tokenizer`` where vLLM can load them, embeddings untied."""
    directory.mkdir(parents=True, exist_ok=True)
    to_save = model
    if getattr(model.config, "tie_word_embeddings", False):
        to_save = copy.deepcopy(model)
        to_save.config.tie_word_embeddings = False
        embedding = to_save.get_input_embeddings().weight
        to_save.get_output_embeddings().weight = torch.nn.Parameter(embedding.detach().clone())
    to_save.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def swap_dir(work_dir: Path) -> Path:
    """Where weight files pass to the worker: RAM-backed ``/dev/shm`` if present."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="asyncrl-vllm-", dir=shm))
    path = work_dir / "swap"
    path.mkdir(parents=True, exist_ok=True)
    return path


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts."""


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"model.lora.rank={rank}: vLLM serves LoRA adapters of rank {VLLM_LORA_RANKS[-1]} at "
        "most; use a lower rank, generators.backend=hf, or model.lora.publish=merged"
    )


def write_adapter(
    folder: Path, tensors: dict[str, torch.Tensor], adapters: LoraConfig, base: str
) -> None:
    """Write ``tensors`` (one version's adapters) as the peft folder vLLM loads a
    ``LoRARequest`` from, on the base model at ``base``; anything there before goes."""
    from safetensors.torch import save_file

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file(lora.peft_file_names(tensors), folder / "adapter_model.safetensors")
    settings = lora.adapter_config_json(adapters, tensors, base)
    (folder / "adapter_config.json").write_text(json.dumps(settings))
