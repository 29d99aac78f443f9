"""Which built-in scores a ``data_source``, as verl's ``default_compute_score`` picks it;
and a name with none stops ``asyncrl launch``/``validate`` before any process starts,
naming the file and row it first appears in."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.generation import tasks
from asyncrl.generation.envs.tool_env import default_score
from asyncrl.generation.rewards import (
    ERROR_NO_FUNCTION,
    RewardFunctionError,
    builtin_reward_function,
    check_reward_sources,
    digits_score,
    gsm8k_score,
    known_data_sources,
    math_dapo_score,
    math_score,
    reward_range,
)
from asyncrl.generation.rewards.worker import score_one
from asyncrl.run import preflight as preflight_module
from asyncrl.run.preflight import preflight
from tests.helpers.preflight import character_tokenizer_dir, config_for, jsonl, problems_of, row

VERL_NAMES = {
    "openai/gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math_dapo": math_dapo_score,
    "math": math_dapo_score,
    "math_dapo_reasoning": math_dapo_score,
    "aime": math_dapo_score,
    "aime2024": math_dapo_score,
    "aime_2025/I": math_dapo_score,
}
OUR_NAMES = {"synthetic/digits": digits_score, "gsm8k": gsm8k_score}


@pytest.mark.parametrize("data_source, function", [*VERL_NAMES.items(), *OUR_NAMES.items()])
def test_a_data_source_resolves_to_its_scorer(data_source, function):
    assert builtin_reward_function(data_source) is function


@pytest.mark.parametrize("data_source", ["AIME2024", "my/aime", "MATH", "gsm8k_x", "", None, 3])
def test_other_names_have_no_built_in(data_source):
    assert builtin_reward_function(data_source) is None  # case and position matter, as in verl


def test_the_known_names_list_the_prefix_and_the_ranges_say_dapo_goes_negative():
    names = known_data_sources().split(", ")
    assert "aime*" in names and "math_dapo" in names and "openai/gsm8k" in names
    assert names == sorted(names)
    assert reward_range(math_dapo_score) == (-1.0, 1.0)
    assert reward_range(math_score) == (0.0, 1.0)


def test_check_reward_sources_resolves_as_the_workers_do():
    check_reward_sources(None, ["aime2025", "math", "openai/gsm8k"])
    with pytest.raises(RewardFunctionError, match=r"'my/set'; built in: .*aime\*"):
        check_reward_sources(None, ["aime2025", "my/set"])
    with pytest.raises(RewardFunctionError, match="'my/set'"):
        tasks.check_reward_sources(None, ["my/set"])


def test_a_worker_scores_an_aime_row_with_the_dapo_scorer():
    assert score_one(None, ("aime2024", "Answer: 17", "17", None)) == (1.0, None, "")
    assert score_one(None, ("aime2024", "Answer: 16", "17", None)) == (-1.0, None, "")
    reward, error, detail = score_one(None, ("my/set", "Answer: 17", "17", None))
    assert (reward, error) == (0.0, ERROR_NO_FUNCTION) and "'my/set'" in detail


def test_an_environment_default_score_resolves_the_same_way():
    assert default_score("aime2024", "Answer: 17", "17") == 1.0
    assert default_score("aime2024", "Answer: 16", "17") == -1.0  # not the generic 0.0
    assert default_score("math", r"\boxed{17}", "17") == -1.0  # math is DAPO's: no Answer:


# --------------------------------------------------------------------------
# at start-up (asyncrl.run.preflight)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """test_preflight's character tokenizer, with a chat template."""
    return character_tokenizer_dir(tmp_path_factory)


@pytest.fixture(autouse=True)
def no_machine_problems(monkeypatch):
    """This machine's cores and GPUs are not what these tests are about."""
    monkeypatch.setattr(preflight_module, "machine_problems", lambda config: [])


def test_an_unknown_data_source_names_its_first_file_and_row_and_the_known_names(
    tmp_path, tokenizer_dir
):
    train = jsonl(tmp_path / "train.jsonl", row("a", source="aime2024"), row("b", source="aime"))
    held_out = jsonl(tmp_path / "test.jsonl", row("c"), row("d", source="my/set"))
    later = jsonl(tmp_path / "later.jsonl", row("e", source="my/set"))
    config = config_for(
        tokenizer_dir, [train, later], "eval.every_steps=5", f"eval.files=[{held_out}]"
    )
    assert problems_of(config) == [  # once, at its first row: the train files are read first
        f"reward.function: {later}:1: no built-in reward function for data_source 'my/set' "
        f"(built in: {known_data_sources()}); set reward.function to module:function or "
        "path/to/file.py:function"
    ]


def test_aime_rows_start_when_the_reward_range_holds_minus_one(tmp_path, tokenizer_dir):
    train = jsonl(
        tmp_path / "train.jsonl", row("a", source="openai/gsm8k"), row("b", "17", "aime24")
    )
    preflight(config_for(tokenizer_dir, [train]))  # reward.min defaults to -10
    assert problems_of(config_for(tokenizer_dir, [train], "reward.min=0")) == [
        f"reward.min, reward.max: {train}:2: data_source 'aime24' is scored by "
        "math_dapo_score, which gives -1..1, outside 0..10: the buffer would refuse such samples"
    ]


def test_a_parquet_file_names_the_row_too(tmp_path, tokenizer_dir):
    pyarrow = pytest.importorskip("pyarrow")
    from pyarrow import parquet

    rows = [row("a"), row("b", source="lighteval/MATH"), row("c", source="nope")]
    path = tmp_path / "train.parquet"
    parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    problems = problems_of(config_for(tokenizer_dir, [path]))
    assert len(problems) == 1
    assert problems[0].startswith(f"reward.function: {path}:3: no built-in reward function")


def test_a_reward_function_for_every_row_needs_no_built_in(tmp_path, tokenizer_dir):
    train = jsonl(tmp_path / "train.jsonl", row("a", source="my/set"))
    module = tmp_path / "score.py"
    module.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    preflight(config_for(tokenizer_dir, [train], f"reward.function={module}:score"))
