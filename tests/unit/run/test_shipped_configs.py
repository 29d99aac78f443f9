"""Every config in configs/ validates, and the GPU ones say what their comments promise.

Nothing here starts an engine or downloads a model: the checks are on the
validated config and on what can be built without weights (the environment).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.generation.envs import ToolEnvironment
from asyncrl.generation.envs.factory import environment_factory
from asyncrl.generation.rewards import REWARD_FUNCTIONS, check_reward_sources
from asyncrl.run.cli import main

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path, capsys):
    # --no-data: gsm8k data and the Hub tokenizers are not on this machine
    assert main(["validate", str(path), "--no-data"]) == 0, capsys.readouterr().err
    config = load_config(path)
    assert config.algorithm.samples_per_step >= config.learner.minibatches
    assert config.generators.chunk_tokens <= config.generators.max_new_tokens


def test_gsm8k_grpo_is_qwen_on_one_gpu_with_vllm():
    config = load_config(CONFIGS / "gsm8k_grpo.yaml")
    assert config.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert config.generators.backend == "vllm" and config.generators.replicas == 1
    assert (config.learner.device, config.learner.world_size) == ("cuda", 1)
    assert config.learner.mixed_precision == "bf16"
    assert config.data.train_files == ["data/gsm8k/train.parquet"]
    # rows from examples/data/gsm8k.py carry data_source openai/gsm8k: a built-in scorer
    check_reward_sources(config.reward.function, {"openai/gsm8k": 1})
    assert "openai/gsm8k" in REWARD_FUNCTIONS
    assert config.environment is None
    # partial rollouts: several weight checks per response
    assert config.generators.max_new_tokens // config.generators.chunk_tokens >= 4


def test_tool_calling_runs_the_python_tool_multi_turn():
    config = load_config(CONFIGS / "tool_calling.yaml")
    assert config.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert config.generators.backend == "vllm"
    environment = config.environment
    assert environment is not None and environment.name == "tools"
    assert environment.tools == ["python"] and environment.max_turns > 1
    assert environment.formatter == "template"  # Qwen's own chat template
    assert environment.max_total_tokens > config.data.max_prompt_tokens
    env = environment_factory(environment)()
    assert isinstance(env, ToolEnvironment) and list(env.tools) == ["python"]
    # a GSM8K row gets the tool listing in its system message, then the question
    row = {
        "prompt": [{"role": "user", "content": "What is 6 * 7?"}],
        "data_source": "openai/gsm8k",
        "reward_model": {"ground_truth": "42"},
    }
    messages = env.reset(row)
    assert messages[0]["role"] == "system" and '"name": "python"' in messages[0]["content"]
    assert messages[-1] == row["prompt"][0]
    # the final answer is scored by the GSM8K reward of its data_source
    assert env.step("6 * 7 = 42\n#### 42").reward == 1.0
