"""The arithmetic behind the run-level benchmarks, on hand-made inputs (nothing is timed).

benchmarks/ is not a package: the scripts are loaded from their files, as
``python benchmarks/X.py`` would run them.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


common = load("common")
sweep = load("staleness_sweep")
async_vs_sync = load("async_vs_sync")
real_model = load("real_model")


def test_ideal_ratio_is_two_when_phases_are_equal_and_falls_as_one_dominates():
    assert common.ideal_ratio(0.1, 0.1) == pytest.approx(2.0)
    assert common.ideal_ratio(3.0, 1.0) == pytest.approx(4 / 3)  # (3 + 1) / 3
    assert common.ideal_ratio(1.0, 3.0) == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="positive"):
        common.ideal_ratio(0.0, 1.0)


def test_speedup_captured_maps_sync_speed_to_0_and_the_ideal_to_1():
    assert common.speedup_captured(1.0, 1.6) == pytest.approx(0.0)
    assert common.speedup_captured(1.6, 1.6) == pytest.approx(1.0)
    assert common.speedup_captured(1.3, 1.6) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no gain"):
        common.speedup_captured(1.2, 1.0)


def test_compare_splits_the_sync_step_into_work_and_idle_time():
    # sync step 0.20 s: generator busy 0.06 s, learner 0.08 s, the other 0.06 s idle;
    # the learner waited 0.12 s of it for the batch
    busy = {"generator-0": {"busy_frac": 0.3}, "learner": {"busy_frac": 0.4}, "buffer": {}}
    sync = {"wait_s": 0.12, "step_s": 0.20, "samples_per_s": 100.0, "tokens_per_s": 1000.0}
    fast = {"step_s": 0.10, "samples_per_s": 170.0, "tokens_per_s": 1800.0}
    out = async_vs_sync.compare(sync | {"busy": busy}, fast)
    assert out["tg_s"] == pytest.approx(0.06)
    assert out["tt_s"] == pytest.approx(0.08)
    assert out["sync_idle_s"] == pytest.approx(0.06)
    assert out["ideal_ratio"] == pytest.approx(1.75)  # (0.06 + 0.08) / 0.08
    assert out["samples_ratio"] == pytest.approx(1.7)
    assert out["tokens_ratio"] == pytest.approx(1.8)
    assert out["ceiling_vs_this_sync"] == pytest.approx(2.5)  # 0.20 / 0.08
    assert out["overlap_efficiency"] == pytest.approx(0.8)  # 0.08 / 0.10
    assert out["ideal_ratio_phases"] == pytest.approx(0.20 / 0.12)


def test_compare_without_kernel_readings_gives_the_phase_split_only():
    sync = {"wait_s": 0.12, "step_s": 0.20, "samples_per_s": 100.0, "tokens_per_s": 1.0}
    out = async_vs_sync.compare(sync | {"busy": {}}, {"samples_per_s": 150.0, "tokens_per_s": 1.0})
    assert out["tg_s"] is None
    assert out["ideal_ratio_phases"] == pytest.approx(0.20 / 0.12)


def test_moving_average_averages_what_exists_at_the_start():
    assert common.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert common.moving_average([5.0], 10) == [5.0]
    with pytest.raises(ValueError, match="window"):
        common.moving_average([1.0], 0)


def test_first_reaching_uses_the_smoothed_reward():
    xs, rewards = [10, 20, 30, 40], [0.0, 1.0, 0.0, 1.0]
    assert common.first_reaching(xs, rewards, 1.0, window=1) == 20
    assert common.first_reaching(xs, rewards, 1.0, window=2) is None  # never above 0.5
    assert common.first_reaching(xs, rewards, 0.5, window=2) == 20
    with pytest.raises(ValueError, match="rewards"):
        common.first_reaching(xs, rewards[:3], 0.5, window=1)


def step(i: int) -> dict:
    return {
        "step": i,
        "time_s": float(i + 1),
        "samples_total": 10 * (i + 1),
        "learner_tokens_per_s": 100.0,
        "time_update_s": 0.5,  # 50 trained tokens a step
        "response_len_mean": 2.0,
    }


def test_steady_throughput_leaves_out_the_first_steps():
    metrics = [step(i) for i in range(4)]
    metrics[1]["response_len_mean"] = 100.0  # a step left out must not count
    rates = common.steady_throughput(metrics, skip=2)
    # from the end of step 1 (t=2, 20 samples) to the end of step 3 (t=4, 40 samples)
    assert rates["samples_per_s"] == pytest.approx(10.0)
    assert rates["step_s"] == pytest.approx(1.0)
    assert rates["tokens_per_s"] == pytest.approx(50.0)
    assert rates["response_tokens_per_s"] == pytest.approx(20.0)  # 10 samples x 2 tokens
    with pytest.raises(ValueError, match="skip"):
        common.steady_throughput(metrics, skip=0)


def test_read_metrics_keeps_the_last_line_of_a_repeated_step(tmp_path: Path):
    lines = [{"step": 0, "reward_mean": 0.1}, {"step": 1, "reward_mean": 0.2}]
    lines.append({"step": 1, "reward_mean": 0.3})  # written again after a resume
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    records = common.read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["reward_mean"] == 0.3


def test_role_name_reads_the_launchers_command_lines():
    base = ["python", "-m", "asyncrl.run.roles"]
    assert common.role_name([*base, "learner", "/r"]) == "learner"
    generator = [*base, "generator", "/r", "--index", "1", "--pool", "default"]
    assert common.role_name(generator) == "generator-1"
    generator[-1] = "fast"
    assert common.role_name(generator) == "generator-fast-1"
    assert common.role_name(["python", "-m", "asyncrl", "launch", "c.yaml"]) is None


def test_busy_fractions_come_from_the_readings_inside_the_window():
    sampler = common.BusySampler(launcher_pid=0, metrics_path=Path("unused"))
    sampler.samples = [
        common.Sample(0.0, 1, {"learner": (0, 0)}),  # start-up: not inside (steps <= 1)
        common.Sample(1.0, 2, {"learner": (int(0.2e9), int(0.1e9))}),
        common.Sample(3.0, 4, {"learner": (int(1.2e9), int(0.5e9))}),
        common.Sample(4.0, 6, {"learner": (int(3.0e9), int(0.5e9))}),  # past the last step
    ]
    busy = sampler.busy(first_step=1, last_step=5)
    # 2 s of wall time: 1.0 s on a CPU, 0.4 s runnable
    assert busy["learner"]["on_cpu_frac"] == pytest.approx(0.5)
    assert busy["learner"]["busy_frac"] == pytest.approx(0.7)
    assert busy["_window"]["seconds"] == pytest.approx(2.0)


def run(staleness: int, correction: str, seed: int, rewards: list[float]) -> dict:
    return {
        "staleness": staleness,
        "correction": correction,
        "seed": seed,
        "staleness_mean": staleness * 0.5,
        "evicted_frac": 0.0,
        "curve": {
            "samples": [100 * (i + 1) for i in range(len(rewards))],
            "time_s": [2.0 * (i + 1) for i in range(len(rewards))],
            "reward": rewards,
            "staleness": [0.0] * len(rewards),
        },
    }


def test_sweep_table_counts_seeds_reaching_the_target_and_takes_medians(monkeypatch):
    monkeypatch.setattr(sweep, "SMOOTH", 1)
    runs = [
        run(0, "tis", 1, [0.1, 0.9, 0.9]),  # reaches 0.8 at 200 samples, 4 s
        run(0, "tis", 2, [0.1, 0.2, 0.9]),  # at 300 samples, 6 s
        run(4, "none", 1, [0.1, 0.2, 0.3]),  # never
    ]
    rows = {(r["staleness"], r["correction"]): r for r in sweep.table(runs, [0.8])}
    on_policy = rows[(0, "tis")]["targets"]["0.8"]
    assert on_policy == {"reached": 2, "samples_median": 250.0, "seconds_median": 5.0}
    stale = rows[(4, "none")]["targets"]["0.8"]
    assert stale == {"reached": 0, "samples_median": None, "seconds_median": None}
    assert rows[(0, "tis")]["seeds"] == 2
    assert rows[(4, "none")]["final_reward_mean"] == pytest.approx(0.2)


def record(i: int, time_s: float, wait: float, update: float, stall: float | None) -> dict:
    out = {"step": i, "time_s": time_s, "learner_wait_s": wait, "time_update_s": update}
    if stall is not None:
        out["time_publish_stall_s"] = stall
    return out


def test_real_model_step_split_leaves_out_start_up_and_keeps_the_rest_of_the_step():
    metrics = [
        record(0, 60.0, wait=20.0, update=40.0, stall=0.1),  # start-up: left out
        record(1, 90.0, wait=2.0, update=27.0, stall=0.2),
        record(2, 120.0, wait=4.0, update=25.0, stall=0.4),
    ]
    split = real_model.step_split(metrics, skip=1)
    # steps 1 and 2 run from t=60 to t=120: 30 s each
    assert split["steps"] == 2 and split["first_step"] == 1
    assert split["step_s"] == pytest.approx(30.0)
    assert split["learner_wait_s"] == pytest.approx(3.0)
    assert split["time_update_s"] == pytest.approx(26.0)
    assert split["time_publish_stall_s"] == pytest.approx(0.3)
    assert split["other_s"] == pytest.approx(0.7)  # logging, checkpoints, ...
    assert split["shares"]["learner_wait_s"] == pytest.approx(0.1)
    # from the learner's start when nothing is left out
    assert real_model.step_split(metrics, skip=0)["step_s"] == pytest.approx(40.0)
    with pytest.raises(ValueError, match="skip"):
        real_model.step_split(metrics, skip=3)


def test_real_model_step_split_names_a_phase_the_run_did_not_log():
    metrics = [record(0, 10.0, 1.0, 8.0, None), record(1, 20.0, 1.0, 8.0, None)]
    split = real_model.step_split(metrics, skip=1)
    assert split["time_publish_stall_s"] is None
    assert split["missing"] == ["time_publish_stall_s"]
    assert split["other_s"] == pytest.approx(1.0)  # 10 - 1 - 8
