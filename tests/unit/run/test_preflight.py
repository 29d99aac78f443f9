"""Launch-time checks (asyncrl.run.preflight): every problem one line, naming the config key
and, for data, the file and row; a reward function is called in a worker process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.run import preflight as preflight_module
from asyncrl.run.preflight import preflight
from tests.helpers.preflight import character_tokenizer_dir, config_for, jsonl, problems_of, row

ROOT = Path(__file__).resolve().parents[3]
SMOLLM2 = ROOT / "models" / "SmolLM2-135M-Instruct"
ARITHMETIC = ROOT / "data" / "arithmetic"
@pytest.fixture(autouse=True)
def no_machine_problems(monkeypatch):
    """This machine's cores and GPUs are not what these tests are about."""
    monkeypatch.setattr(preflight_module, "machine_problems", lambda config: [])


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A saved character tokenizer whose chat template refuses a system turn."""
    return character_tokenizer_dir(tmp_path_factory)


def reward_file(tmp_path: Path, body: str) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(
        "import os, time\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    {body}\n"
    )
    return f"{path}:compute_score"


# --------------------------------------------------------------------------
# prompt files


def test_every_bad_file_and_row_is_listed_with_its_config_key(tmp_path, tokenizer_dir):
    train = jsonl(
        tmp_path / "train.jsonl",
        row("fine"),
        b"\xff not utf-8",
        b"{oops",
        {"prompt": 7},
        b"",
        row("the template refuses a system turn", system=True),
    )
    empty = jsonl(tmp_path / "empty.jsonl")
    held_out = jsonl(tmp_path / "test.jsonl", row("fine"), [1, 2])
    config = config_for(
        tokenizer_dir,
        [train, empty, tmp_path / "missing.jsonl"],
        f"eval.files=[{held_out}]",
        "eval.every_steps=1",
    )
    assert problems_of(config) == [
        f"data.train_files: {train}:2: not UTF-8 text (byte 0xff at byte 1 of the line); "
        "save the file as UTF-8",
        f"data.train_files: {train}:3: not valid JSON at column 2: "
        "Expecting property name enclosed in double quotes",
        f"data.train_files: {train}:4: 'prompt' must be a string or a non-empty list of "
        "{role, content} messages",
        f"data.train_files: {train}:6: the chat template cannot render this prompt: "
        "TemplateError: System role not supported",
        f"data.train_files: {empty}: no rows (the file is empty or blank)",
        f"data.train_files: {tmp_path / 'missing.jsonl'}: no such data file",
        f"eval.files: {held_out}:2: expected an object, got list",
    ]


def test_eval_files_are_read_only_when_eval_is_on(tmp_path, tokenizer_dir):
    train = jsonl(tmp_path / "train.jsonl", row("fine"))
    config = config_for(tokenizer_dir, [train], f"eval.files=[{tmp_path / 'nothing.jsonl'}]")
    preflight(config)


def test_bad_rows_past_the_first_few_are_counted_in_one_line(tmp_path, tokenizer_dir):
    train = jsonl(tmp_path / "train.jsonl", row("fine"), *[b"[]"] * 8)
    problems = problems_of(config_for(tokenizer_dir, [train]))
    assert len(problems) == preflight_module.PROBLEMS_PER_FILE + 1
    assert problems[0] == f"data.train_files: {train}:2: expected an object, got list"
    assert problems[-1] == f"data.train_files: {train}: 3 more bad rows not listed"


def test_rows_past_the_render_limit_are_checked_but_not_rendered(
    tmp_path, tokenizer_dir, monkeypatch
):
    monkeypatch.setattr(preflight_module, "RENDER_LIMIT", 1)
    train = jsonl(tmp_path / "train.jsonl", row("fine"), row("not rendered", system=True), b"7")
    assert problems_of(config_for(tokenizer_dir, [train])) == [
        f"data.train_files: {train}:3: expected an object, got int"
    ]


def test_prompts_that_never_fit_the_limit_are_one_problem(tmp_path, tokenizer_dir):
    train = jsonl(tmp_path / "train.jsonl", row("What is 8 * 9?"), row("Add 2 and 3."))
    config = config_for(tokenizer_dir, [train], "data.max_prompt_tokens=10")
    assert problems_of(config) == [
        "data.train_files: none of the 2 prompts fits in data.max_prompt_tokens=10 once "
        "rendered (the shortest has 30 tokens)"
    ]
    preflight(config_for(tokenizer_dir, [train], "data.max_prompt_tokens=30"))


def test_a_data_source_without_a_reward_function_names_its_first_row(tmp_path, tokenizer_dir):
    train = jsonl(tmp_path / "train.jsonl", row("a"), row("b", source="my/set"), row("c", "my/set"))
    problems = problems_of(config_for(tokenizer_dir, [train]))
    assert len(problems) == 1
    assert problems[0].startswith(
        f"reward.function: {train}:2: no built-in reward function for data_source 'my/set'"
    )


def test_a_tokenizer_that_cannot_load_is_one_problem(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", row("a"))
    config = config_for(tmp_path / "no-model", [train])
    assert problems_of(config) == [
        f"model.name_or_path: no such folder or file {tmp_path}/no-model"
    ]
    (tmp_path / "empty-model").mkdir()
    problem = problems_of(config_for(tmp_path / "empty-model", [train]))
    assert len(problem) == 1
    assert problem[0].startswith(f"model.name_or_path: cannot load the tokenizer of {tmp_path}")


def test_without_data_the_files_are_not_read(tmp_path, tokenizer_dir):
    config = config_for(tokenizer_dir, [tmp_path / "missing.jsonl"])
    assert problems_of(config) == [
        f"data.train_files: {tmp_path / 'missing.jsonl'}: no such data file"
    ]
    preflight(config, data=False)


# --------------------------------------------------------------------------
# the reward function, called in a worker process


@pytest.mark.parametrize(
    "body, failure",
    [
        ("return extra_info['answer']", "raised on this row{given}: KeyError: 'answer'"),
        ("os._exit(3)", "crashed its worker process on this row{given}: the reward worker exited "
         "with code 3"),
        ("time.sleep(60)", "hung on this row{given}: no reward after 1.0s"),
        ("return 'yes'", "returned no finite number on this row{given}: returned 'yes'"),
        ("return 11.0", "scored 11 on this row{given}, outside reward.min..reward.max = -10..10"),
    ],
)  # fmt: skip
def test_a_reward_function_that_fails_on_a_row_names_the_row(
    tmp_path, tokenizer_dir, body, failure
):
    function = reward_file(tmp_path, body)
    train = jsonl(tmp_path / "train.jsonl", row("a", source="my/set"))
    config = config_for(tokenizer_dir, [train], f"reward.function={function}", "reward.timeout_s=1")
    problems = problems_of(config)
    assert len(problems) == 1
    given = preflight_module.GIVEN
    assert problems[0].startswith(
        f"reward.function: {train}:1: {function} {failure.format(given=given)}"
    )


def test_the_built_in_task_calls_the_reward_function_too(tmp_path):
    """The issue: with the built-in task, a reward function that fails made every
    generator fail at start-up and restart for ever."""
    function = reward_file(tmp_path, "return extra_info['answer']")
    config = load_config(None, ["model.tiny={}", f"reward.function={function}"])
    assert problems_of(config) == [
        f"reward.function: task.digits prompt 0: {function} raised on this row"
        f"{preflight_module.GIVEN}: KeyError: 'answer'"
    ]
    fine = reward_file(tmp_path, "return float(solution_str == ground_truth)")
    preflight(load_config(None, ["model.tiny={}", f"reward.function={fine}"]))


def test_the_function_is_called_on_the_first_row_of_each_data_source(tmp_path, tokenizer_dir):
    function = reward_file(tmp_path, "return 1.0 if data_source == 'a' else extra_info['x']")
    train = jsonl(tmp_path / "train.jsonl", row("1", source="a"), row("2", source="b"))
    config = config_for(tokenizer_dir, [train], f"reward.function={function}")
    problems = problems_of(config)
    assert len(problems) == 1 and problems[0].startswith(f"reward.function: {train}:2: ")


# --------------------------------------------------------------------------
# the environment, and the machine


def test_an_environment_whose_tools_do_not_resolve_is_named(tmp_path):
    config = load_config(
        None,
        [
            "model.tiny={}",
            "environment.name=tools",
            "environment.tools=[calculator, abacus]",
            "environment.python_isolation=none",
        ],
    )
    assert problems_of(config) == [
        "environment: unknown tool 'abacus'; built-in tools: calculator, python, "
        "or give module:attr"
    ]
    preflight(config.model_copy(update={"environment": None}))


def test_an_environments_formatter_needs_a_chat_template(tmp_path):
    config = load_config(
        None,
        ["model.tiny={}", "environment.name=tools", "environment.tools=[calculator]"],
    )
    preflight(config)  # formatter auto: ChatML for a tokenizer without a template
    config.environment.formatter = "template"
    problems = problems_of(config)
    assert len(problems) == 1 and problems[0].startswith("environment.formatter: ")
    assert "chat template" in problems[0]


def test_machine_problems_are_listed_unless_asked_not_to(monkeypatch):
    monkeypatch.setattr(
        preflight_module, "machine_problems", lambda config: ["learner.device=cuda, but no GPU"]
    )
    config = load_config(None, ["model.tiny={}"])
    assert problems_of(config) == ["learner.device=cuda, but no GPU"]
    preflight(config, machine=False)


def test_lora_without_peft_installed_is_named_before_any_process_starts(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "peft" else find_spec(name, *a),
    )
    config = load_config(None, ["model.tiny={}", "model.lora.rank=4"])
    assert problems_of(config) == [
        "model.lora: needs peft, not installed here: pip install 'asyncrl[lora]'"
    ]
    preflight(load_config(None, ["model.tiny={}"]))  # without model.lora: no problem


# --------------------------------------------------------------------------
# the real model's tokenizer and data


@pytest.mark.skipif(
    not (SMOLLM2.is_dir() and (ARITHMETIC / "train.parquet").is_file()),
    reason="needs models/SmolLM2-135M-Instruct and data/arithmetic (docs/real-model.md)",
)
def test_the_shipped_smollm2_config_passes_and_a_bad_row_is_named(tmp_path):
    overrides = [
        f"model.name_or_path={SMOLLM2}",
        f"data.train_files=[{ARITHMETIC / 'train.parquet'}]",
        f"eval.files=[{ARITHMETIC / 'test.parquet'}]",
        f"reward.function={ROOT / 'examples/arithmetic/reward.py'}:compute_score",
    ]
    config = load_config(ROOT / "configs" / "smollm2_arithmetic.yaml", overrides)
    preflight(config)
    bad = jsonl(tmp_path / "bad.jsonl", row("1 + 1?", "2", "arithmetic"), b'{"prompt": []}')
    config.data.train_files = [str(bad)]
    assert problems_of(config) == [
        f"data.train_files: {bad}:2: 'prompt' must be a string or a non-empty list of "
        "{role, content} messages"
    ]


def test_chat_prompts_for_a_tokenizer_without_a_chat_template_are_one_problem_a_file(
    tmp_path,
):
    """The tiny model's tokenizer has none (a base model's has none either)."""
    train = jsonl(tmp_path / "train.jsonl", row("a"), row("b"))
    overrides = [f"data.train_files=[{train}]", f"eval.files=[{train}]", "eval.every_steps=1"]
    problems = problems_of(load_config(None, ["model.tiny={}", *overrides]))
    said = "2 chat-message prompts, and the tokenizer of model.tiny (its built-in tokenizer) "
    advice = "has no chat template (a base model?): give 'prompt' as a plain string, or use "
    assert problems == [
        f"{key}: {train}: {said}{advice}a model whose tokenizer has one"
        for key in ("data.train_files", "eval.files")
    ]


def test_plain_text_prompts_need_no_chat_template_and_the_preflight_names_the_form(tmp_path):
    text = {
        "prompt": "12 + 30 =",
        "data_source": "arithmetic",
        "reward_model": {"ground_truth": "42"},
    }
    train = jsonl(tmp_path / "train.jsonl", text, text)
    reward = "reward.function=examples/arithmetic/reward.py:compute_score"
    config = load_config(None, ["model.tiny={}", f"data.train_files=[{train}]", reward])
    assert preflight(config, machine=False) == [
        f"data.train_files: {train}: 2 rows of plain text (as it is, the tokenizer's BOS rule)"
    ]
