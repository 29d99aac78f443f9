"""benchmarks/vs_trl.py compares like with like: the settings both sides run with are the
shipped config's, TRL sees the task's own reward, and the report's arithmetic holds."""

from __future__ import annotations

import importlib.util

import pytest

from asyncrl.config import load_config
from tests.helpers.scripts import benchmark

workers = benchmark("vs_trl_workers")
vs_trl = benchmark("vs_trl")


def test_both_sides_run_the_shipped_real_model_config_s_settings():
    config = load_config(vs_trl.CONFIG, vs_trl.ASYNCRL_OVERRIDES)
    settings = workers.SETTINGS
    assert settings["prompts_per_step"] == config.algorithm.prompts_per_step
    assert settings["group_size"] == config.algorithm.group_size
    assert settings["lr"] == config.learner.lr and config.learner.lr_schedule == "constant"
    assert settings["temperature"] == config.generators.temperature
    assert settings["max_new_tokens"] == config.generators.max_new_tokens
    assert settings["clip"] == config.algorithm.clip_low == config.algorithm.clip_high
    assert settings["grad_clip"] == config.learner.grad_clip
    assert config.algorithm.kl_coef == 0 and config.algorithm.aggregation == "token-mean"
    # the work TRL does not do is off on asyncrl's side too
    assert config.eval.every_steps == 0 and not config.eval.before_training
    assert config.learner.checkpoint_every == 0


def test_trl_scores_completions_with_the_task_s_reward_function():
    completions = [
        [{"role": "assistant", "content": "7"}],
        [{"role": "assistant", "content": "It is 7."}],
        [{"role": "assistant", "content": "8"}],
    ]
    scores = workers.arithmetic_reward(
        prompts=[None] * 3,
        completions=completions,
        ground_truth=["7"] * 3,
        data_source=["arithmetic"] * 3,
    )
    assert scores == [1.0, 0.5, 0.0]


@pytest.mark.skipif(
    importlib.util.find_spec("trl") is None, reason="trl: bash scripts/setup.sh dev,bench"
)
def test_trl_is_configured_as_asyncrl_where_its_defaults_differ(tmp_path):
    config = workers.trl_config(tmp_path, seed=3, steps=5)
    assert config.per_device_train_batch_size == 32 and config.num_generations == 8
    assert not config.gradient_checkpointing and config.beta == 0.0
    assert config.loss_type == "dapo" and config.scale_rewards == "group"
    assert config.lr_scheduler_type == "constant" and config.max_steps == 5


def test_the_summary_takes_the_steady_median_and_ten_step_reward_windows():
    run = {
        "step_s": [30.0] + [10.0] * 14 + [12.0] * 10,
        "to_last_step_s": 300.0,
        "command_s": 330.0,
        "learner_tokens_per_s": [50.0] * 15 + [100.0] * 10,
        "reward_mean": [0.1] * 10 + [0.2] * 10 + [0.4] * 5,
    }
    summary = vs_trl.summarise(run, from_step=16)
    assert summary["median_step_s"] == 12.0 and summary["median_step_s_all"] == 10.0
    assert summary["learner_tokens_per_s"] == 100.0
    assert summary["reward_by_window"] == pytest.approx([0.1, 0.2, 0.4])


def test_the_report_states_asyncrl_s_speed_against_trl_s_over_the_seeds():
    def run(tool, seed, to_last):
        summary = {
            "median_step_s": 1.0,
            "median_step_s_all": 1.0,
            "to_last_step_s": to_last,
            "command_s": 1.0,
            "learner_tokens_per_s": 1.0,
            "reward_by_window": [0.5],
        }
        bound = {"generate_share": [0.3, 0.3]} if tool == "trl" else {"learner_wait_frac": 0.05}
        return {
            "tool": tool,
            "seed": seed,
            "summary": summary,
            "eval": {"reward_mean": 0.4, "reward_stderr": 0.02},
            **bound,
        }

    report = {
        "machine": {"cpu": "cpu", "nproc": 2, "loadavg_start": [0.1]},
        "commit": "abc",
        "steps": 40,
        "from_step": 16,
        "runs": [
            run("trl", 0, 900.0),
            run("asyncrl", 0, 400.0),
            run("asyncrl", 1, 500.0),
            run("trl", 1, 900.0),
        ],
    }
    text = vs_trl.markdown(report)
    assert "asyncrl reaches step 40 2.00x as fast as TRL" in text
    assert text.count("| trl seed") == 2 and "0.400 ± 0.020" in text
    assert "in turn: generating and scoring 30% of a step" in text
    assert "| asyncrl | 2 | 0.400 | 450 | the learner: the learner waits for data 5%" in text


def test_reports_of_more_seeds_merge_into_one_with_every_run_and_commit():
    first = {"commit": "a1", "machine": {"cpu": "x"}, "steps": 40, "runs": [{"seed": 0}]}
    later = {"commit": "b2", "machine": {"cpu": "y"}, "steps": 40, "runs": [{"seed": 2}]}
    report = vs_trl.merged([first, later])
    assert [run["seed"] for run in report["runs"]] == [0, 2]
    assert report["commit"] == "a1, b2" and report["machine"] == {"cpu": "x"}
    assert first["runs"] == [{"seed": 0}]  # the reports read are left as they were
