"""The tool-use example: its data script, its reward and its config agree."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.generation.envs.factory import environment_factory

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "calculator"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"calculator_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_held_out_products_are_never_trained_on_nor_the_worked_examples():
    data = _module("data")
    splits = data.splits(seed=0)
    pairs = {
        split: [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows]
        for split, rows in splits.items()
    }
    assert (len(pairs["train"]), len(pairs["test"])) == (data.TRAIN, data.TEST)
    assert not set(pairs["train"]) & set(pairs["test"])
    assert len(set(pairs["train"])) == data.TRAIN
    assert not set(data.EXAMPLES) & (set(pairs["train"]) | set(pairs["test"]))
    for rows in splits.values():
        for row in rows:
            a, b = row["extra_info"]["a"], row["extra_info"]["b"]
            assert row["reward_model"]["ground_truth"] == str(a * b)
            assert row["prompt"][-1] == {"role": "user", "content": f"What is {a} * {b}?"}
    assert data.splits(seed=1)["test"] != splits["test"]


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("517 * 238 = 123046", 1.0),
        ("123,046", 1.0),
        ("The answer is 123046.", 1.0),
        ("123046 is close to 123047", 0.0),  # the last number counts
        ("123045", 0.0),
        ("I cannot compute that.", 0.0),
    ],
)
def test_the_reward_pays_only_a_right_last_number(answer, score):
    assert _module("reward").compute_score("calculator", answer, "123046") == score


def test_a_worked_example_is_what_the_environment_accepts_as_a_call_and_an_answer():
    """The examples in every prompt must show a call the tool environment runs, and an
    answer its reward pays: a format the model copies that failed would teach nothing."""
    config = load_config(ROOT / "configs" / "smollm2_tools.yaml")
    env = environment_factory(config.environment)()
    row = _module("data").row(517, 238, "test", 0)
    env.reset(row)
    _question, call, tool, answer = _module("data").worked_example(517, 238)
    called = env.step(call["content"])
    assert (called.done, called.tool_calls, called.tool_errors) == (False, 1, 0)
    assert called.messages[0]["content"] == tool["content"] == "123046"
    assert env.step(answer["content"]).reward == 1.0
