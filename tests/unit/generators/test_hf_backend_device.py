"""Where the HF backend generates: the CPU by default, the GPU its pool asks for
(``generators.num_gpus``), and a clear refusal where that GPU is missing. The CUDA side
itself runs in tests/gpu/test_generation_cuda.py."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import GeneratorsConfig, ModelConfig, TinyModelConfig
from asyncrl.generation.models import build_policy
from asyncrl.generators.hf_backend import HFBackend


def test_a_pool_that_asks_for_no_gpu_generates_on_the_cpu():
    model, tokenizer = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    backend = HFBackend(model, tokenizer, GeneratorsConfig())
    assert backend.device == torch.device("cpu")
    assert {p.device.type for p in backend.model.parameters()} == {"cpu"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the GPU asked for")
def test_a_pool_that_asks_for_a_gpu_is_refused_without_one_naming_the_key():
    # before, the replica silently generated on the CPU while Ray held a GPU for it
    model, tokenizer = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    with pytest.raises(RuntimeError, match=r"generators\.num_gpus=0\.5 asks for a GPU"):
        HFBackend(model, tokenizer, GeneratorsConfig(num_gpus=0.5))
