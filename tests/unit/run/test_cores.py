"""Each learner rank and generator replica computes on cores of its own (asyncrl/core/cores.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.core.cores import CORES_ENV, CorePlan, pinning_problems, plan_cores, torch_threads
from asyncrl.core.machine import machine_problems

REAL_MODEL = Path(__file__).parents[3] / "configs" / "smollm2_arithmetic.yaml"


def config(*overrides: str, path: Path | None = None):
    base = [] if path else ["model.tiny.num_layers=2"]  # the quickstart's tiny model
    return load_config(path, [*base, *overrides])


def test_the_real_model_config_on_two_cores_gives_each_role_one():
    # it asks for a 2-thread learner and a 1-thread generator: 3 threads for 2 cores
    plan = plan_cores(config(path=REAL_MODEL), [0, 1])
    assert plan.cores == {"learner": (0,), "generator-0": (1,)}
    assert plan.summary().startswith(
        "cores: learner cpu 0 (1 thread), generator-0 cpu 1 (1 thread)"
    )


def test_on_a_larger_machine_each_gets_what_it_asks_and_no_core_is_shared():
    plan = plan_cores(
        config(
            "learner.world_size=2",
            "learner.num_threads=4",
            "generators.replicas=3",
            "generators.num_threads=2",
        ),
        range(16),
    )
    assert [len(cores) for cores in plan.cores.values()] == [4, 4, 2, 2, 2]
    assert set(plan.cores) == {"learner", "learner-1", "generator-0", "generator-1", "generator-2"}
    every = [core for cores in plan.cores.values() for core in cores]
    assert len(every) == len(set(every))  # disjoint


def test_when_they_do_not_fit_the_process_holding_most_gives_up_cores_first():
    plan = plan_cores(
        config("learner.num_threads=6", "generators.replicas=2", "generators.num_threads=2"),
        [0, 1, 2, 3, 4, 5],
    )
    assert {name: len(cores) for name, cores in plan.cores.items()} == {
        "learner": 2,
        "generator-0": 2,
        "generator-1": 2,
    }


def test_more_processes_than_cores_pins_nothing_and_says_why():
    plan = plan_cores(config("generators.replicas=2"), [0, 1])  # the quickstart: 3 for 2
    assert plan.cores == {}
    assert (
        plan.reason
        == "3 learner ranks and generator replicas for 2 cores: each needs one of its own"
    )
    assert "not pinned (3 learner ranks" in plan.summary()


def test_pin_cores_false_pins_nothing_and_true_is_refused_where_it_cannot_pin():
    assert plan_cores(config("cluster.pin_cores=false"), [0, 1]).reason == "cluster.pin_cores=false"
    cores = len(os.sched_getaffinity(0))
    crowded = config("cluster.pin_cores=true", f"generators.replicas={cores}")
    assert pinning_problems(crowded) == [
        f"cluster.pin_cores=true, but {cores + 1} learner ranks and generator replicas for "
        f"{cores} cores: each needs one of its own"
    ]
    assert pinning_problems(crowded)[0] in machine_problems(crowded)


def test_a_pinned_process_runs_one_torch_thread_per_core(monkeypatch):
    assert torch_threads(3) == 3  # not pinned: as configured
    monkeypatch.setenv(CORES_ENV, "0,1")
    assert torch_threads(3) == 2


def test_the_plan_round_trips_through_the_run_directory(tmp_path: Path):
    plan = CorePlan({"learner": (1,), "generator-0": (0,)})
    plan.save(tmp_path)
    assert CorePlan.load(tmp_path) == plan
    (tmp_path / "cores.json").write_text("{not json")
    assert CorePlan.load(tmp_path) is None


@pytest.mark.parametrize("device", ["cuda"])
def test_a_cuda_learner_rank_asks_for_one_core(device: str):
    plan = plan_cores(config(f"learner.device={device}", "learner.num_threads=8"), [0, 1, 2])
    assert plan.cores["learner"] == (0,)
