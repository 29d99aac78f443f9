"""Reward functions: GSM8K and MATH answers by hand, loading by name, and a scorer that
survives functions that raise, hang or crash."""

from __future__ import annotations

import textwrap
import time

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.generation import tasks
from asyncrl.generation.rewards import (
    REWARD_FUNCTIONS,
    RewardFunctionError,
    RewardScorer,
    Score,
    check_reward_sources,
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_score,
    gsm8k_score_flexible,
    load_reward_function,
    math_dapo_score,
    math_equal,
    math_score,
    normalize_math_answer,
)

# --------------------------------------------------------------------------
# GSM8K


@pytest.mark.parametrize(
    "response, truth, reward",
    [
        ("6 + 66 = 72 clips.\n#### 72", "72", 1.0),
        ("#### 1,200", "1200", 1.0),
        ("#### $18.00", "18", 1.0),
        ("####-3", "-3", 1.0),
        ("It costs $18.\n####   18.", "18", 1.0),
        ("#### 0.50", "0.5", 1.0),
        ("first #### 5, then corrected: #### 72", "72", 1.0),  # the last marker counts
        ("#### 71", "72", 0.0),
        ("#### 7.2", "72", 0.0),
        ("the answer is 72", "72", 0.0),  # strict: no marker, no answer
        ("####", "72", 0.0),
        ("", "72", 0.0),
    ],
)
def test_gsm8k_score(response, truth, reward):
    assert gsm8k_score("openai/gsm8k", response, truth, {}) == reward


def test_gsm8k_flexible_falls_back_to_the_last_number_only_without_a_marker():
    assert gsm8k_score_flexible("openai/gsm8k", "3 apples, so 72 in all.", "72") == 1.0
    assert gsm8k_score_flexible("openai/gsm8k", "72 then #### 71", "72") == 0.0
    assert gsm8k_score_flexible("openai/gsm8k", "no numbers", "72") == 0.0
    assert extract_gsm8k_answer("so 1,234.50 dollars", flexible=True) == "1234.5"
    assert extract_gsm8k_answer("so 1,234.50 dollars") is None


# --------------------------------------------------------------------------
# MATH


def test_extract_boxed_takes_the_last_box_with_balanced_braces():
    assert extract_boxed(r"so $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} no, \boxed{\sqrt{2}+{3}}") == r"\sqrt{2}+{3}"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"$\boxed 5$") == "5"
    assert extract_boxed(r"\boxed{\frac{1}{2}") is None  # unclosed
    assert extract_boxed("the answer is 5") is None


@pytest.mark.parametrize(
    "answer, truth",
    [
        (r"\dfrac{1}{2}", r"\frac12"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        ("1/2", r"\frac{1}{2}"),
        ("0.5", r"\frac{1}{2}"),
        (".5", "0.5"),
        ("-.25", r"-\frac{1}{4}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"90^{\circ}", "90"),
        (r"5 \text{ cm}", "5"),
        (r"\text{(A)}", "(A)"),
        ("x = 3", "3"),
        (r"\$10", "10"),
        (r"10\%", "10"),
        ("1,000", "1000"),
        ("7.", "7"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"2\!\sqrt{2}", r"2\sqrt{2}"),
        ("3.0", "3"),
    ],
)
def test_math_answers_that_are_equal(answer, truth):
    assert math_equal(answer, truth), (normalize_math_answer(answer), normalize_math_answer(truth))


@pytest.mark.parametrize(
    "answer, truth",
    [
        (r"\frac{1}{3}", "0.33"),
        ("2", "3"),
        ("(1,2)", "(2,1)"),
        (r"\sqrt{2}", "2"),
    ],
)
def test_math_answers_that_differ(answer, truth):
    assert not math_equal(answer, truth)


def test_normalisation_drops_left_and_right_but_not_rightarrow():
    assert normalize_math_answer(r"\left[ x \rightarrow 1 \right]") == r"[x\rightarrow1]"


def test_math_score_reads_the_last_box_against_a_boxed_or_plain_truth():
    response = r"Adding, $\frac{2}{4} = \boxed{\dfrac{1}{2}}$."
    assert math_score("lighteval/MATH", response, r"\frac{1}{2}") == 1.0
    assert math_score("lighteval/MATH", response, r"\boxed{\frac12}") == 1.0
    assert math_score("lighteval/MATH", response, "2") == 0.0
    assert math_score("lighteval/MATH", "the answer is 1/2", "1/2") == 0.0  # no box


# --------------------------------------------------------------------------
# the registry and loading by name


def test_registry_covers_the_built_in_data_sources():
    assert REWARD_FUNCTIONS["synthetic/digits"] is tasks.digits_score
    assert REWARD_FUNCTIONS["openai/gsm8k"] is gsm8k_score
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval"):
        assert REWARD_FUNCTIONS[source] is math_score
    assert REWARD_FUNCTIONS["math"] is math_dapo_score  # verl's: "math" is DAPO's scorer
    assert tasks.REWARD_FUNCTIONS is REWARD_FUNCTIONS  # the old name still imports


USER_FUNCTIONS = """
import os
import time

NOT_A_FUNCTION = 3


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)


def misbehave(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("this reward function is broken")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "exit":
        os._exit(3)
    if solution_str == "nan":
        return float("nan")
    if solution_str == "dict":
        return {"score": 0.25, "acc": True}
    if solution_str == "extra":
        return extra_info["weight"]
    return float(solution_str == ground_truth)
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(textwrap.dedent(USER_FUNCTIONS))
    return path


def test_load_by_module_and_by_file(user_file):
    assert load_reward_function("asyncrl.generation.rewards:gsm8k_score") is gsm8k_score
    exact = load_reward_function(f"{user_file}:exact")
    assert exact("x", " 42 ", "42", None) == 1.0
    assert load_reward_function(f"{user_file}:exact") is exact  # loaded once


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gsm8k_score", "expected module:function or path/to/file.py:function"),
        ("asyncrl.generation.rewards:", "expected module:function"),
        ("missing_dir/nothing.py:f", "no such file"),
        ("asyncrl.no_such_module:f", "cannot import module 'asyncrl.no_such_module'"),
        ("asyncrl.generation.rewards:no_such_function", "has no 'no_such_function'"),
    ],
)
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(RewardFunctionError, match=message):
        load_reward_function(spec)


def test_bad_specs_in_a_file_name_the_file_and_what_is_there(user_file, tmp_path):
    with pytest.raises(RewardFunctionError, match=r"my_rewards.py has no 'exakt'.*exact"):
        load_reward_function(f"{user_file}:exakt")
    with pytest.raises(RewardFunctionError, match=r"is a int, not a function"):
        load_reward_function(f"{user_file}:NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_package_anywhere\n")
    with pytest.raises(
        RewardFunctionError, match=r"loading .*broken.py raised ModuleNotFoundError"
    ):
        load_reward_function(f"{broken}:f")


def test_unknown_data_sources_fail_before_any_sample_is_scored(user_file):
    check_reward_sources(None, ["openai/gsm8k", "synthetic/digits"])
    with pytest.raises(RewardFunctionError, match=r"'my/dataset'.*reward.function="):
        check_reward_sources(None, ["openai/gsm8k", "my/dataset"])
    check_reward_sources(f"{user_file}:exact", ["my/dataset"])  # one function for every row
    with pytest.raises(RewardFunctionError):
        check_reward_sources(f"{user_file}:nope", ["my/dataset"])


def test_reward_config_keys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.py").write_text("def score(*args, **kwargs):\n    return 1.0\n")
    config = load_config(
        None, ["model.tiny={}", "reward.function=my.py:score", "reward.timeout_s=2.5"]
    )
    assert (config.reward.function, config.reward.timeout_s, config.reward.workers) == (
        "my.py:score",
        2.5,
        1,
    )
    assert load_config(None, ["model.tiny={}"]).reward.function is None
    with pytest.raises(ConfigError, match=r"reward.timeout_s"):
        load_config(None, ["model.tiny={}", "reward.timeout_s=0"])


# --------------------------------------------------------------------------
# the scorer: off the caller's thread, and never stuck


def test_scorer_uses_the_data_source_s_built_in():
    with RewardScorer(timeout_s=10) as scorer:
        scores = scorer.score_many(
            [
                ("openai/gsm8k", "#### 72", "72", {}),
                ("lighteval/MATH", r"\boxed{\frac12}", "0.5", None),
                ("synthetic/digits", "483", "483", None),
                ("my/dataset", "72", "72", None),
            ]
        )
        assert scores[:3] == [Score(1.0), Score(1.0), Score(1.0)]
        assert scores[3].reward == 0.0
        assert scores[3].error == "error:no_reward_function"
        assert scorer.counters["scored"] == 3
        assert scorer.counters["error:no_reward_function"] == 1


def test_a_raising_function_scores_zero_with_a_tag_and_scoring_goes_on(user_file):
    with RewardScorer(f"{user_file}:misbehave", timeout_s=10) as scorer:
        scores = scorer.score_many(
            [
                ("x", "raise", "a", None),
                ("x", "a", "a", None),
                ("x", "nan", "a", None),
                ("x", "dict", "a", None),
                ("x", "extra", "a", {"weight": 0.75}),
            ]
        )
        assert scores[0].reward == 0.0
        assert scores[0].error == "error:exception"
        assert "this reward function is broken" in scores[0].detail
        assert scores[1] == Score(1.0)
        assert scores[2][:2] == (0.0, "error:bad_return")
        assert scores[3] == Score(0.25)  # verl's dict form
        assert scores[4] == Score(0.75)  # extra_info reaches the function
        assert scorer.counters["error:exception"] == 1
        assert scorer.counters["error:bad_return"] == 1
        assert scorer.counters["errors"] == 2
        assert scorer.counters["workers_started"] == 1  # an exception costs no worker


def test_a_hanging_function_times_out_without_blocking_the_caller(user_file):
    timeout_s = 1.0
    with RewardScorer(f"{user_file}:misbehave", timeout_s=timeout_s) as scorer:
        assert scorer.score("x", "a", "a") == Score(1.0)  # the worker is up

        started = time.monotonic()
        futures = [scorer.submit("x", text, "a") for text in ("a", "hang", "a")]
        assert time.monotonic() - started < 0.5  # submit never waits for scoring
        assert not futures[1].done()

        ok, hung, after = (future.result(timeout=timeout_s + 10) for future in futures)
        assert time.monotonic() - started < timeout_s + 8
        assert ok == Score(1.0)
        assert hung.reward == 0.0
        assert hung.error == "error:timeout"
        assert after == Score(1.0)  # queued behind the hung one: scored by the replacement
        assert scorer.counters["error:timeout"] == 1
        assert scorer.counters["workers_started"] == 2

        assert scorer.score("x", "b", "b") == Score(1.0)  # and it keeps working
        assert scorer.score("x", "b", "c") == Score(0.0)


def test_a_function_that_kills_its_worker_scores_zero_and_the_worker_is_replaced(user_file):
    with RewardScorer(f"{user_file}:misbehave", timeout_s=10) as scorer:
        crashed, after = scorer.score_many([("x", "exit", "a", None), ("x", "a", "a", None)])
        assert crashed[:2] == (0.0, "error:crashed")
        assert after == Score(1.0)
        assert scorer.counters["error:crashed"] == 1


def test_a_bad_function_fails_when_the_scorer_is_made(user_file):
    with pytest.raises(RewardFunctionError, match=r"has no 'nope'"):
        RewardScorer(f"{user_file}:nope")
    with pytest.raises(ValueError, match=r"timeout_s"):
        RewardScorer(timeout_s=0)
