"""Which engine a generator replica runs: :func:`build_backend`.

Apart from :mod:`asyncrl.generators.backend` (the contract both engines
implement), so that the contract imports neither engine and each engine imports
only the contract.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from asyncrl.config import Config
    from asyncrl.generators.backend import Backend


def build_backend(
    config: Config,
    model: torch.nn.Module,
    tokenizer,
    work_dir: Path,
    seed: int = 0,
) -> Backend:
    """The engine ``config.generators.backend`` names, holding ``model``'s weights as version 0.

    With LoRA adapters published alone (``model.lora.publish: adapter``) the engine holds
    ``model`` as its base and applies each version's adapters (see each backend).
    ``work_dir`` is this replica's own directory: the vLLM backend writes the
    model there (vLLM loads a model from a directory) and its weight updates
    pass through it. vLLM is imported only here, only when asked for.
    """
    generators = config.generators
    adapters = config.model.lora if config.model.publishes_adapters else None
    if generators.backend == "hf":
        from asyncrl.generators.hf_backend import HFBackend

        return HFBackend(model, tokenizer, generators, adapters=adapters)
    if generators.backend == "vllm":
        from asyncrl.generators.vllm_backend import VLLMBackend

        return VLLMBackend.from_model(
            model, tokenizer, generators, work_dir, dtype=config.model.dtype, seed=seed,
            adapters=adapters,
        )  # fmt: skip
    raise ValueError(f"unknown generators.backend {generators.backend!r}")
