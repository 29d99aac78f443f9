"""The FSDP2 learner on one CUDA device (NCCL, world size 1) in bf16 mixed precision:
it trains on a batch collated straight onto the device, and its steps match the same
steps in fp32 on the CPU within bf16's rounding."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from asyncrl.learner.policy import Learner
from tests.helpers.gpu import device_batch, tiny_config
from tests.helpers.learner import single_rank

STEPS = 2
COMPARED = ("loss_policy", "learner_grad_norm", "learner_entropy")


Check = Callable[[Learner, dict[str, torch.Tensor]], None]


def two_steps(
    device: str, mixed_precision: str, check: Check | None = None
) -> list[dict[str, float]]:
    """Metrics of two train steps of a fresh tiny learner; ``check(learner, before)``
    runs after them, with the weights from before the first step."""
    with single_rank(device) as ranks:
        config = tiny_config(device, mixed_precision)
        torch.manual_seed(config.run.seed)
        learner = Learner(config, ranks)
        before = {name: tensor.clone() for name, tensor in learner.full_tensors()}
        metrics = [learner.train_step(device_batch(step, ranks.device)) for step in range(STEPS)]
        if check is not None:
            check(learner, before)
        return metrics


def trained_on_cuda(learner: Learner, before: dict[str, torch.Tensor]) -> None:
    assert learner.ranks.device.type == "cuda"
    assert torch.distributed.get_backend() == "nccl"
    parameters = list(learner.model.parameters())
    assert {p.to_local().device.type for p in parameters} == {"cuda"}
    assert {p.grad.to_local().device.type for p in parameters if p.grad is not None} == {"cuda"}
    assert any(p.grad is not None for p in parameters), "the last step kept no gradient"
    after = dict(learner.full_tensors())
    assert all(torch.isfinite(tensor).all() for tensor in after.values())
    moved = [name for name in before if not torch.equal(after[name], before[name])]
    assert len(moved) == len(before), f"unchanged: {sorted(set(before) - set(moved))}"


def test_bf16_steps_on_cuda_train_and_match_fp32_on_the_cpu():
    cuda = two_steps("cuda", "bf16", check=trained_on_cuda)
    cpu = two_steps("cpu", "none")
    for step, (got, want) in enumerate(zip(cuda, cpu, strict=True)):
        assert math.isfinite(got["loss_policy"])
        for key in COMPARED:  # step 0's policy loss is near 0 (ratio 1): hence abs as well
            assert got[key] == pytest.approx(want[key], rel=2e-2, abs=1e-3), f"step {step} {key}"
