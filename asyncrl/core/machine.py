"""What this machine can give a run: asked at launch, never by the schema.

A config is valid anywhere and may be meant for a bigger machine, so a rank
count above this machine's devices is not a config error; the launcher (and
``asyncrl validate``) asks :func:`machine_problems` before starting anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config, LearnerConfig


def machine_problems(
    config: Config, *, cuda_devices: int | None = None, cpus: int | None = None
) -> list[str]:
    """What this machine cannot give the run, one line each; empty when it fits. Not schema
    errors: a config is valid anywhere and may be meant for a bigger machine, so the launcher
    asks this before starting. A Ray cluster joined at `cluster.address` may span machines:
    then nothing is checked. ``cuda_devices``/``cpus``: this machine's, found when None."""
    if config.cluster.backend == "ray" and config.cluster.address is not None:
        return []
    gpus = _cuda_device_count() if cuda_devices is None else cuda_devices
    cores = _cpu_count() if cpus is None else cpus
    from asyncrl.core.cores import pinning_problems

    return [
        *_learner_problems(config.learner, gpus, cores),
        *_generator_problems(config, gpus),
        *pinning_problems(config),
    ]


def _learner_problems(learner: LearnerConfig, gpus: int, cpus: int) -> list[str]:
    if learner.device == "cuda" and gpus == 0:
        return ["learner.device=cuda, but this machine has no CUDA device"]
    if learner.device == "cuda" or (learner.device == "auto" and gpus > 0):
        if learner.world_size > gpus:
            return [
                f"learner.world_size={learner.world_size} is more than the {gpus} CUDA "
                "device(s) of this machine: each rank needs a GPU of its own"
            ]
    elif learner.world_size > 4 * cpus:
        return [
            f"learner.world_size={learner.world_size} is more than 4x the {cpus} CPUs of "
            "this machine: the ranks would spend their time waiting for a core"
        ]
    return []


def _generator_problems(config: Config, gpus: int) -> list[str]:
    pools = config.generators.resolved_pools()
    asked = sum(pool.replicas * pool.settings.num_gpus for pool in pools)
    if asked > gpus:
        return [
            f"generator replicas ask for {asked:g} GPU(s) (replicas x generators.num_gpus), "
            f"but this machine has {gpus} CUDA device(s)"
        ]
    return []


GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Where a GPU driver shows itself: NVIDIA's, ROCm's (torch.cuda on AMD), WSL2's."""


def _cuda_device_count() -> int:
    """CUDA devices torch sees (honours CUDA_VISIBLE_DEVICES); 0 without torch or CUDA.

    Without any GPU driver torch can see no device, and the launcher need not import
    torch to learn it (a second and more of every launch's start on a small CPU)."""
    if not any(Path(path).exists() for path in GPU_DRIVER_PATHS):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count()


def _cpu_count() -> int:
    """CPUs this process may run on (its affinity), else all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
