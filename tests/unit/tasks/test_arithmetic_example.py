"""The real-model example: its data script, its reward and its config agree."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.generation.data import PromptDataset
from asyncrl.generation.rewards import load_reward_function
from asyncrl.generation.tasks import build_tokenizer

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "arithmetic"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"arithmetic_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_test_split_is_disjoint_from_train_and_every_pair_appears_once():
    splits = _module("data").splits(seed=0)
    pairs = {
        split: [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows]
        for split, rows in splits.items()
    }
    assert not set(pairs["train"]) & set(pairs["test"])
    everything = pairs["train"] + pairs["test"]
    assert sorted(everything) == [(a, b) for a in range(16) for b in range(16)]
    assert len(pairs["test"]) == 64
    for rows in splits.values():
        for row in rows:
            a, b = row["extra_info"]["a"], row["extra_info"]["b"]
            assert row["reward_model"]["ground_truth"] == str(a + b)
            assert f"{a} + {b}" in row["prompt"][-1]["content"]


def test_another_seed_holds_out_other_pairs():
    data = _module("data")
    first = {r["extra_info"]["index"]: r["prompt"][-1]["content"] for r in data.splits(0)["test"]}
    second = {r["extra_info"]["index"]: r["prompt"][-1]["content"] for r in data.splits(1)["test"]}
    assert first != second


def test_the_written_files_load_as_prompt_data(tmp_path):
    subprocess.run(
        [sys.executable, str(EXAMPLE / "data.py"), "--output", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    train = PromptDataset(tmp_path / "train.parquet", tokenizer, max_prompt_tokens=4096)
    test = PromptDataset(tmp_path / "test.parquet", tokenizer, max_prompt_tokens=4096)
    assert (len(train), len(test)) == (192, 64)
    assert dict(train.data_sources) == {"arithmetic": 192}


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("12", 1.0),
        ("12.", 1.0),
        (" 12\n", 1.0),
        ("7 + 5 = 12.", 0.5),  # right, but not alone
        ("The answer is 12", 0.5),
        ("12 apples, then 13", 0.0),  # the last number counts
        ("13", 0.0),
        ("112", 0.0),
        ("", 0.0),
    ],
)
def test_reward_pays_the_bare_right_number_most(reply, score):
    compute_score = load_reward_function(f"{EXAMPLE / 'reward.py'}:compute_score")
    assert compute_score("arithmetic", reply, "12", {}) == score


def test_the_real_model_config_is_asynchronous_and_points_at_the_example():
    config = load_config(ROOT / "configs" / "smollm2_arithmetic.yaml")
    assert config.buffer.max_staleness >= 1
    assert config.model.name_or_path == "models/SmolLM2-135M-Instruct"  # scripts/smollm2.sh
    assert config.reward.function == "examples/arithmetic/reward.py:compute_score"
    assert config.data.train_files == ["data/arithmetic/train.parquet"]
    assert config.eval.files == ["data/arithmetic/test.parquet"]
    assert config.eval.before_training
    assert "models/SmolLM2-135M-Instruct" in (ROOT / "scripts" / "smollm2.sh").read_text()
