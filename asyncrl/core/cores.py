"""Which cores each process of a local run computes on, so the roles never fight over one.

A learner rank and a generator replica each run torch's thread pool. Left to the
operating system on a machine with fewer cores than their threads add up to, they
share cores, and a thread pool that waits for a pre-empted thread at every
barrier loses far more than its share: on 2 cores, a 2-thread learner beside a
1-thread generator trained at 41-56 tokens/s where the same forward and backward
alone did 112.

:func:`plan_cores` gives each compute process (learner ranks, generator replicas)
cores of its own, as many as it asks for (``learner.num_threads``, a pool's
``num_threads``) while they fit; when they do not, it takes one core at a time from
the process holding the most until they do, and each process runs as many torch
threads as it holds cores. The buffer, the launcher, reward workers and sandboxed
tools are not pinned (a reward worker inherits its replica's cores). When there
are more compute processes than cores nothing is pinned, and the plan says why.

``cluster.pin_cores`` (``auto``, ``true``, ``false``) decides whether the local
launcher applies the plan; the Ray backend leaves placement to Ray.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config

CORES_ENV = "ASYNCRL_CORES"
"""The cores a process started by the launcher is pinned to: ``0,1``."""
PLAN_FILE = "cores.json"
"""The plan in the run directory, for ``asyncrl status``."""


@dataclass(frozen=True)
class CorePlan:
    """Cores by process name (``learner``, ``learner-1`` for rank 1, ``generator-0``, ...);
    empty with ``reason`` saying why nothing is pinned."""

    cores: dict[str, tuple[int, ...]] = field(default_factory=dict)
    reason: str = ""

    def of(self, name: str, rank: int = 0) -> tuple[int, ...] | None:
        """The cores of ``name`` (rank ``rank`` of a learner), None when not pinned."""
        return self.cores.get(process_name(name, rank))

    def summary(self) -> str:
        """One line for the console: who computes on which cores."""
        if not self.cores:
            return f"cores: not pinned ({self.reason})"
        parts = [
            f"{name} {_ranges(cores)} ({len(cores)} thread{'s' * (len(cores) > 1)})"
            for name, cores in self.cores.items()
        ]
        return "cores: " + ", ".join(parts) + "; the buffer and helpers on any core"

    def save(self, run_dir: Path) -> None:
        text = json.dumps({"cores": self.cores, "reason": self.reason}, indent=1)
        (run_dir / PLAN_FILE).write_text(text + "\n")

    @classmethod
    def load(cls, run_dir: Path) -> CorePlan | None:
        """The plan a launcher saved in ``run_dir``; None if there is none or it is unreadable."""
        try:
            data = json.loads((run_dir / PLAN_FILE).read_text())
            cores = {str(name): tuple(int(c) for c in ids) for name, ids in data["cores"].items()}
            return cls(cores, str(data.get("reason", "")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None


def process_name(name: str, rank: int = 0) -> str:
    """A learner's rank 0 is ``learner``, rank 1 ``learner-1``: every other name as is."""
    return f"{name}-{rank}" if rank else name


def requests(config: Config) -> dict[str, int]:
    """Cores each compute process asks for: its torch threads (a CUDA learner rank: 1)."""
    from asyncrl.core.paths import replica_name

    learner = config.learner
    per_rank = 1 if learner.device == "cuda" else learner.num_threads
    wanted = {process_name("learner", rank): per_rank for rank in range(learner.world_size)}
    for pool in config.generators.resolved_pools():
        for index in range(pool.replicas):
            wanted[replica_name(pool.name, index)] = pool.settings.num_threads
    return wanted


def plan_cores(config: Config, available: Sequence[int]) -> CorePlan:
    """The cores of every compute process of ``config`` on the ``available`` ones."""
    if config.cluster.pin_cores is False:
        return CorePlan(reason="cluster.pin_cores=false")
    wanted = requests(config)
    available = sorted(available)
    if len(wanted) > len(available):
        return CorePlan(
            reason=f"{len(wanted)} learner ranks and generator replicas for "
            f"{len(available)} cores: each needs one of its own"
        )
    share = dict(wanted)
    while sum(share.values()) > len(available):
        most = max(share, key=lambda name: (share[name], name.startswith("learner")))
        share[most] -= 1
    cores, next_core = {}, 0
    for name, count in share.items():
        cores[name] = tuple(available[next_core : next_core + count])
        next_core += count
    return CorePlan(cores)


def launcher_plan(config: Config) -> CorePlan:
    """The plan for the cores this launcher may use."""
    return plan_cores(config, sorted(os.sched_getaffinity(0)))


def pinning_problems(config: Config) -> list[str]:
    """``cluster.pin_cores=true`` on a machine where it cannot pin, one line; else none."""
    if config.cluster.pin_cores is not True or config.cluster.backend != "local":
        return []
    plan = launcher_plan(config)
    return [] if plan.cores else [f"cluster.pin_cores=true, but {plan.reason}"]


def given_cores() -> tuple[int, ...] | None:
    """The cores the launcher gave this process (``ASYNCRL_CORES``), None if none."""
    given = os.environ.get(CORES_ENV)
    return tuple(int(core) for core in given.split(",")) if given else None


def pin_this_process() -> None:
    """Keep this process, and the threads and processes it starts, on its given cores."""
    if (cores := given_cores()) is not None:
        os.sched_setaffinity(0, cores)


def torch_threads(configured: int) -> int:
    """Torch threads to run: one per given core, else ``configured``."""
    cores = given_cores()
    return configured if cores is None else len(cores)


def _ranges(cores: tuple[int, ...]) -> str:
    """``cpu 0``, ``cpus 2-5``, ``cpus 0,2``."""
    if len(cores) == 1:
        return f"cpu {cores[0]}"
    if list(cores) == list(range(cores[0], cores[-1] + 1)):
        return f"cpus {cores[0]}-{cores[-1]}"
    return "cpus " + ",".join(map(str, cores))
