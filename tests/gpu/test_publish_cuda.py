"""Weights a CUDA learner publishes (``Learner.full_tensors``) load into a generator's CPU
model through ``HFBackend.load_weights``, and that model gives the learner's logits."""

from __future__ import annotations

import pytest
import torch

from asyncrl.generation.models import empty_like
from asyncrl.generators.hf_backend import HFBackend
from asyncrl.learner import sharding
from asyncrl.learner.policy import Learner
from tests.helpers.gpu import device_batch, tiny_config
from tests.helpers.learner import single_rank

TOLERANCE = {"none": 1e-4, "bf16": 2e-2}
"""Absolute, on logits of magnitude < 1: float32 rounding, or bf16 compute on the learner
(0.003 apart when checked on the CPU; one step of training moves them by 0.6)."""


def learner_and_generator_logits(device: str, mixed_precision: str):
    """Logits of a batch from a learner after one step, and from a CPU generator model
    that loaded the weights it published."""
    with single_rank(device) as ranks:
        config = tiny_config(device, mixed_precision)
        torch.manual_seed(config.run.seed)
        learner = Learner(config, ranks)
        learner.train_step(device_batch(0, ranks.device))  # weights unlike a fresh model's
        published = dict(learner.full_tensors())
        assert {tensor.device.type for tensor in published.values()} == {"cpu"}

        model = empty_like(learner.policy_config, torch.float32)
        generator = HFBackend(model, learner.tokenizer, config.generators)
        generator.load_weights(published, version=learner.version)
        assert generator.version == learner.version == 1

        batch = device_batch(1, "cpu")
        learner.model.eval()
        with torch.no_grad():
            on_device = batch.input_ids.to(ranks.device), batch.attention_mask.to(ranks.device)
            theirs, _ = sharding.forward(learner.model, *on_device)
            ours = generator.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        real = batch.attention_mask.bool()
        return theirs.float().cpu()[real], ours.logits[real]


@pytest.mark.parametrize("mixed_precision", ["none", "bf16"])
def test_weights_published_from_cuda_give_a_cpu_generator_the_learners_logits(mixed_precision):
    learner_logits, generator_logits = learner_and_generator_logits("cuda", mixed_precision)
    tolerance = TOLERANCE[mixed_precision]
    torch.testing.assert_close(generator_logits, learner_logits, rtol=0, atol=tolerance)
