"""Contract tests for the plug-in points a config names by ``module:function`` or
``module:Class``: reward functions (``reward.function``, an environment's
``compute_score``) and environments (``environment.name``).

Each plug-in is a module of its own on the import path, loaded by the loader the
product uses (:func:`asyncrl.generation.rewards.load_reward_function` in the
:class:`~asyncrl.generation.rewards.RewardScorer`'s workers;
:func:`asyncrl.generation.envs.factory.environment_factory` in a generator replica), so what
passes here is what a run accepts.
"""

from __future__ import annotations

import math
import textwrap

import pytest

from asyncrl.config.environment import ISOLATIONS, EnvironmentConfig
from asyncrl.generation.envs import Codec, PlainTextFormatter, StepResult, run_episode
from asyncrl.generation.envs.base import Environment, ScoreRequest
from asyncrl.generation.envs.factory import environment_factory, load_environment
from asyncrl.generation.envs.loading import PluginError
from asyncrl.generation.rewards import (
    REWARD_FUNCTIONS,
    RewardFunctionError,
    RewardScorer,
    Score,
    load_reward_function,
    reward_range,
)

PLUGINS = '''
from asyncrl.generation.envs import Environment, ScoreRequest, StepResult


def exact(data_source, solution_str, ground_truth, extra_info=None):
    """The documented signature, returning a float."""
    return float(solution_str.strip() == ground_truth)


def verl_dict(data_source, solution_str, ground_truth, extra_info=None):
    """verl's dict form: the "score" entry is the reward, the rest is ignored."""
    return {"score": 0.25, "acc": True}


def uses_extra_info(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["weight"])


def two_arguments(solution_str, ground_truth):
    return 1.0


def infinite(data_source, solution_str, ground_truth, extra_info=None):
    return float("inf")


def boolean(data_source, solution_str, ground_truth, extra_info=None):
    return True


NOT_CALLABLE = 3


class Guess(Environment):
    """Subclasses the API: one turn, scored by a named reward function."""

    def __init__(self, answer="42"):
        self.answer = answer

    def reset(self, row):
        return [{"role": "user", "content": "guess"}]

    def step(self, response):
        request = ScoreRequest("contract_plugins:exact", response, "x", self.answer)
        return StepResult(done=True, score_request=request)


class DuckTyped:
    """Has reset(row) and step(response), subclasses nothing: also accepted."""

    def reset(self, row):
        return [{"role": "user", "content": "say hi"}]

    def step(self, response):
        return StepResult(done=True, reward=float(response == "hi"))


class NoStep:
    def reset(self, row):
        return []


not_a_class = Guess()
'''


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """``contract_plugins`` importable here and, through the import path, in reward workers."""
    (tmp_path / "contract_plugins.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "contract_plugins"


# --------------------------------------------------------------------------
# reward functions: reward(data_source, solution_str, ground_truth, extra_info=None)


def test_a_module_function_reward_is_loaded_by_name_and_scored_in_a_worker(plugins):
    assert load_reward_function(f"{plugins}:exact")("x", " 42 ", "42") == 1.0
    with RewardScorer(f"{plugins}:exact", timeout_s=30) as scorer:
        hit, miss = scorer.score_many([("x", "42", "42", None), ("x", "41", "42", None)])
    assert (hit, miss) == (Score(1.0), Score(0.0))


def test_a_reward_may_return_verl_s_dict_and_reads_extra_info(plugins):
    with RewardScorer(timeout_s=30) as scorer:
        dict_form = scorer.submit("x", "", "", None, f"{plugins}:verl_dict").result(60)
        extra = scorer.submit("x", "", "", {"weight": 0.5}, f"{plugins}:uses_extra_info")
        assert dict_form == Score(0.25)
        assert extra.result(60) == Score(0.5)


@pytest.mark.parametrize(
    "function, tag, detail",
    [
        ("two_arguments", "error:exception", "TypeError"),  # the wrong signature
        ("infinite", "error:bad_return", "not finite"),
        ("boolean", "error:bad_return", "bool is not a real number"),
    ],
)
def test_a_reward_that_breaks_the_contract_costs_its_sample_with_the_documented_tag(
    plugins, function, tag, detail
):
    with RewardScorer(f"{plugins}:{function}", timeout_s=30) as scorer:
        score = scorer.score("x", "42", "42")
        assert score[:2] == (0.0, tag)
        assert detail in score.detail
        assert scorer.counters[tag] == 1


@pytest.mark.parametrize(
    "name, message",
    [("nope", "has no 'nope'"), ("NOT_CALLABLE", "is a int, not a function")],
)
def test_a_name_that_is_not_a_reward_function_fails_before_any_worker_starts(
    plugins, name, message
):
    with pytest.raises(RewardFunctionError, match=message):
        RewardScorer(f"{plugins}:{name}")


def test_every_built_in_reward_keeps_the_contract():
    for data_source, function in REWARD_FUNCTIONS.items():
        name = f"{function.__module__}:{function.__name__}"
        assert load_reward_function(name) is function  # nameable in a config
        reward = function(data_source, "no answer here", "42", None)
        assert isinstance(reward, float) and math.isfinite(reward), data_source
        low, high = reward_range(function)
        assert low <= reward <= high and -1.0 <= low < high <= 1.0


# --------------------------------------------------------------------------
# environments: reset(row) -> messages, step(response) -> StepResult

CHARS = Codec(encode=lambda text: [ord(c) for c in text], decode=lambda ids: "".join(map(chr, ids)))


def _say(text: str):
    """A model that says ``text`` then ends its turn."""

    def generate(token_ids, max_new_tokens, stop):
        ids = CHARS.encode(text + stop[0])
        return ids, [-0.5] * len(ids), [0] * len(ids)

    return generate


def test_an_environment_class_is_built_fresh_per_episode_by_name(plugins):
    make = environment_factory(EnvironmentConfig(name=f"{plugins}:Guess", kwargs={"answer": "7"}))
    first, second = make(), make()
    assert first is not second and isinstance(first, Environment)
    assert first.answer == "7"
    result = first.step("7")
    assert result.done and result.score_request.score_here() == 1.0


def test_a_duck_typed_environment_runs_an_episode(plugins):
    env = load_environment(f"{plugins}:DuckTyped")
    trajectory = run_episode(env, {}, _say("hi"), CHARS, PlainTextFormatter())
    assert (trajectory.finish_reason, trajectory.reward) == ("stop", 1.0)


def test_a_score_request_from_an_environment_is_scored_by_the_named_function(plugins):
    env = load_environment(f"{plugins}:Guess")
    env.reset({})
    result = env.step("42")
    assert isinstance(result, StepResult) and isinstance(result.score_request, ScoreRequest)
    request = result.score_request
    with RewardScorer(timeout_s=30) as scorer:
        args = (request.data_source, request.solution_str, request.ground_truth, None)
        assert scorer.submit(*args, request.function).result(60) == Score(1.0)


@pytest.mark.parametrize(
    "spec, kwargs, message",
    [
        ("NoStep", {}, "neither subclasses asyncrl.generation.envs.Environment nor has reset"),
        ("not_a_class", {}, "is a Guess, not a class"),
        ("Guess", {"colour": "red"}, r"Guess\(\*\*\['colour'\]\) failed"),
        ("Missing", {}, "Missing"),
    ],
)
def test_an_environment_that_breaks_the_contract_fails_when_the_factory_is_made(
    plugins, spec, kwargs, message
):
    with pytest.raises(PluginError, match=message):
        environment_factory(EnvironmentConfig(name=f"{plugins}:{spec}", kwargs=kwargs))


def test_the_schema_and_the_sandbox_know_the_same_isolations():
    from asyncrl.generation.envs.sandbox import ISOLATIONS as SANDBOX_ISOLATIONS

    assert ISOLATIONS == SANDBOX_ISOLATIONS
