"""The `eval:` section: its checks, and the held-out prompts the buffer evaluates on."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.generation.tasks import eval_work_items, work_item_factory
from tests.helpers.data import chat_tokenizer, row, write_jsonl

TINY = "model.tiny={}"


def problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(None, [TINY, *overrides])
    return str(caught.value)


def test_eval_is_off_by_default_and_has_no_prompts():
    config = load_config(None, [TINY])
    assert not config.eval.enabled
    assert (config.eval.every_steps, config.eval.files, config.eval.before_training) == (
        0,
        [],
        False,
    )
    assert eval_work_items(config) == []


@pytest.mark.parametrize(
    ("overrides", "complaint"),
    [
        (
            ["eval.every_steps=3", "learner.sync_interval=2", "buffer.max_staleness=1"],
            "eval.every_steps=3 must be a multiple of learner.sync_interval=2",
        ),
        (
            ["eval.every_steps=5", "data.train_files=[train.jsonl]"],
            "eval.files is empty but data.train_files is set",
        ),
        (
            ["eval.every_steps=5", "task.num_digits=2", "eval.max_prompts=51"],
            "eval.max_prompts=51 is more than half of the 100 prompts of task.num_digits=2",
        ),
        (
            ["eval.every_steps=5", "eval.samples_per_prompt=65"],
            "eval.samples_per_prompt=65 is more than generators.max_active_samples=64",
        ),
        (
            [
                "eval.every_steps=5",
                "eval.samples_per_prompt=16",
                "generators.pools=[{name: a}, {name: b, max_active_samples: 8}]",
            ],
            "generators.max_active_samples=8 (pool 'b')",
        ),
        (["eval.every_steps=-1"], "eval.every_steps: Input should be greater than or equal to 0"),
        (["eval.max_prompts=0"], "eval.max_prompts: Input should be greater than or equal to 1"),
        (["eval.every_step=5"], "did you mean 'eval.every_steps'?"),
    ],
)
def test_settings_eval_cannot_run_with_are_refused_naming_the_keys(overrides, complaint):
    assert complaint in problems(*overrides)


def test_the_checks_apply_only_when_eval_is_on():
    config = load_config(None, [TINY, "eval.samples_per_prompt=500", "eval.max_prompts=900"])
    assert not config.eval.enabled


# ---------------------------------------------------------- built-in task


def built_in(*overrides: str):
    return load_config(None, [TINY, "eval.every_steps=10", *overrides])


def test_built_in_eval_prompts_are_fixed_distinct_and_negative_group_ids():
    config = built_in("eval.max_prompts=40", "eval.samples_per_prompt=3")
    items = eval_work_items(config)
    assert [item.group_id for item in items] == [-1 - j for j in range(40)]
    assert all(item.num_samples == 3 and item.eval_round == -1 for item in items)
    assert len({tuple(item.prompt_ids) for item in items}) == 40
    assert eval_work_items(config) == items  # every round evaluates the same prompts
    assert items[0].data_source == "synthetic/digits"


def test_training_never_draws_an_eval_prompt_and_is_otherwise_unchanged():
    with_eval = built_in("eval.max_prompts=100")
    held_out = {tuple(item.prompt_ids) for item in eval_work_items(with_eval)}
    training = work_item_factory(with_eval)
    without = work_item_factory(load_config(None, [TINY]))
    trained = [training(index) for index in range(3000)]
    assert not [item for item in trained if tuple(item.prompt_ids) in held_out]
    # 3 digits, 1000 prompts: the plain stream hits held-out ones, the eval run redraws them
    plain = [without(index) for index in range(3000)]
    hits = [index for index, item in enumerate(plain) if tuple(item.prompt_ids) in held_out]
    assert hits
    assert all(trained[i] == plain[i] for i in range(3000) if i not in hits)


def test_eval_prompts_carry_messages_for_an_environment():
    config = built_in("environment.name=tools", "eval.max_prompts=2")
    items = eval_work_items(config)
    assert [item.messages[0]["role"] for item in items] == ["user", "user"]
    assert items[0].messages[0]["content"].endswith("=")


# ----------------------------------------------------------------- files


def test_eval_prompts_from_files_are_a_fixed_sample_of_distinct_rows(tmp_path):
    tokenizer = chat_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    rows = [row(f"question {n}?", str(n), source="openai/gsm8k") for n in range(6)]
    path = write_jsonl(tmp_path / "test.jsonl", rows)
    config = load_config(
        None,
        [
            f"model.name_or_path={tmp_path / 'tokenizer'}",
            f"data.train_files=[{path}]",
            "eval.every_steps=5",
            f"eval.files=[{path}]",
            "eval.max_prompts=4",
        ],
    )
    items = eval_work_items(config)
    assert [item.group_id for item in items] == [-1, -2, -3, -4]
    assert len({item.ground_truth for item in items}) == 4  # four different rows
    assert {item.data_source for item in items} == {"openai/gsm8k"}
    assert items[0].extra_info == {"index": 0}
    assert eval_work_items(config) == items
    # more prompts asked for than the files hold: all of them, once each
    config.eval.max_prompts = 50
    assert sorted(item.ground_truth for item in eval_work_items(config)) == list("012345")


def test_the_gsm8k_config_evaluates_on_the_test_split_the_converter_writes():
    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "gsm8k_grpo.yaml")
    assert config.data.train_files == ["data/gsm8k/train.parquet"]
    assert config.eval.files == ["data/gsm8k/test.parquet"]  # examples/data/gsm8k.py's test split
    assert config.eval.enabled and config.eval.before_training
    assert config.eval.every_steps < config.run.total_steps
