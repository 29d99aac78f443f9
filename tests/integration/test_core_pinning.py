"""A launched run keeps its learner and its generator on cores of their own
(asyncrl/core/cores.py)."""

from __future__ import annotations

import json

import psutil
import pytest

from tests.helpers.run_processes import processes_of
from tests.helpers.watched_launch import Launch

pytestmark = pytest.mark.slow


def role_of(process: psutil.Process) -> str | None:
    command = process.cmdline()
    return command[3] if command[1:3] == ["-m", "asyncrl.run.roles"] else None


@pytest.mark.skipif(len(psutil.Process().cpu_affinity()) < 2, reason="needs two cores")
def test_the_learner_and_the_generator_compute_on_cores_of_their_own(tmp_path):
    run = Launch(tmp_path, "run.total_steps=12", "generators.replicas=1")
    try:
        run.wait_until(lambda: run.steps() >= 3, "step 3")
        affinity = {}
        for process in processes_of(run.run_dir):
            role = role_of(process)
            if role in ("learner", "generator", "buffer"):
                affinity[role] = process.cpu_affinity()
        assert run.process.wait(timeout=180) == 0, run.stderr()
    finally:
        run.stop()
    plan = json.loads((run.run_dir / "cores.json").read_text())["cores"]
    assert affinity["learner"] == plan["learner"] and affinity["generator"] == plan["generator-0"]
    assert len(affinity["learner"]) == 1 and len(affinity["generator"]) == 1  # 1 + 1 thread asked
    assert not set(affinity["learner"]) & set(affinity["generator"])
    assert affinity["buffer"] == psutil.Process().cpu_affinity()  # the buffer runs anywhere
    learner, generator = affinity["learner"][0], affinity["generator"][0]
    said = f"cores: learner cpu {learner} (1 thread), generator-0 cpu {generator} (1 thread)"
    assert said in run.out.read_text() + run.stderr()
