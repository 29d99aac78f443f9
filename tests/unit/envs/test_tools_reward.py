"""The built-in tool environment scores final answers with ``reward.function``."""

from __future__ import annotations

from pathlib import Path

from asyncrl.config import config_from_dict
from asyncrl.generation.envs.factory import environment_factory

REWARD = Path(__file__).resolve().parents[3] / "examples" / "calculator" / "reward.py"


def tools_config(**environment) -> dict:
    return {
        "model": {"name_or_path": "tiny"},
        "reward": {"function": f"{REWARD}:compute_score"},
        "environment": {"name": "tools", "tools": ["calculator"], **environment},
    }


def final_answer_reward(config) -> float:
    env = environment_factory(config.environment)()
    env.reset({"prompt": "What is 12 * 34?", "reward_model": {"ground_truth": "408"}})
    return env.step("12 * 34 = 408").reward


def test_the_tools_environment_takes_reward_function_when_it_names_none():
    config = config_from_dict(tools_config())
    assert config.environment.kwargs["compute_score"] == f"{REWARD}:compute_score"
    # the calculator task's reward reads the last number; the default would compare the
    # whole text with the ground truth and score this 0
    assert final_answer_reward(config) == 1.0


def test_its_own_compute_score_wins():
    own = "asyncrl.generation.envs.tool_env:default_score"
    config = config_from_dict(tools_config(kwargs={"compute_score": own}))
    assert config.environment.kwargs["compute_score"] == own
    assert final_answer_reward(config) == 0.0
