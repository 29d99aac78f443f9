"""A config naming a built-in module by its name before the layers became packages
gets an error that gives the new name, from both plug-in loaders."""

from __future__ import annotations

import pytest

from asyncrl.generation.envs.loading import PluginError, load_object
from asyncrl.generation.rewards import RewardFunctionError, load_reward_function

OLD_REWARDS = "asyncrl." + "rewards"  # spelled apart: the old name, never a live import


def test_a_reward_function_under_the_old_module_name_is_refused_with_the_new_one():
    with pytest.raises(RewardFunctionError) as raised:
        load_reward_function(f"{OLD_REWARDS}:gsm8k_score")
    assert "write asyncrl.generation.rewards" in str(raised.value)
    assert callable(load_reward_function("asyncrl.generation.rewards:gsm8k_score"))


def test_a_plug_in_under_an_old_module_name_is_refused_with_the_new_one():
    old_tool_env = "asyncrl." + "envs.tool_env"
    with pytest.raises(PluginError) as raised:
        load_object(f"{old_tool_env}:default_score", what="compute_score")
    assert "write asyncrl.generation.envs.tool_env" in str(raised.value)


def test_a_module_that_never_existed_gets_the_installation_hint():
    with pytest.raises(PluginError) as raised:
        load_object("no_such_package_here:thing")
    assert "is it installed, or on PYTHONPATH?" in str(raised.value)
