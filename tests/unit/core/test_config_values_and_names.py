"""Issue 27, F3 and F5 in the config: a value YAML holds but Python cannot read (an integer
of more than 4300 digits, in any base; a date that does not exist) is one line naming the
file, line and key, not a traceback; and names that become paths (`run.name`, pool names)
hold only the documented characters."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, config_from_dict, load_config
from asyncrl.config.base import NAME_CHARACTERS

MODEL = "model:\n  tiny: {}\n"
DIGITS = "1" * 5000


def only_problem(path: Path | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["model.tiny={}", *overrides] if path is None else list(overrides))
    problems = caught.value.problems
    assert len(problems) == 1, problems
    assert "\n" not in problems[0]
    return problems[0]


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(MODEL + text)
    return path


# --------------------------------------------------------------------------
# F3: values that cannot be read


@pytest.mark.parametrize("number", [DIGITS, f"-{DIGITS}", "0x" + "f" * 5000, "0b" + "1" * 20000])
def test_an_integer_past_4300_digits_names_file_line_and_key(tmp_path, number):
    path = config_file(tmp_path, f"run:\n  seed: {number}\n")

    assert only_problem(path) == (
        f"{path}:4: run.seed: an integer of more than 4300 digits; no config value needs one "
        "(Python reads no longer integer from text)"
    )


def test_an_integer_past_4300_digits_in_an_override_names_the_override():
    problem = only_problem(None, [f"run.seed={DIGITS}"])

    assert problem.startswith("override 'run.seed=1111")
    assert problem.endswith("': an integer of more than 4300 digits; no config value needs one "
                            "(Python reads no longer integer from text)")  # fmt: skip


def test_an_integer_deep_in_environment_kwargs_is_refused_too(tmp_path):
    path = config_file(tmp_path, f"environment:\n  name: tools\n  kwargs:\n    n: {DIGITS}\n")

    assert only_problem(path).startswith(f"{path}:6: environment.kwargs.n: an integer of more")


def test_a_date_that_does_not_exist_names_its_line_and_says_to_quote_it(tmp_path):
    path = config_file(tmp_path, "run:\n  name: 2023-02-30\n")

    assert only_problem(path) == (
        f"{path}:4: run.name: cannot read this value: day is out of range for month "
        "(quote it to keep it as text)"
    )


def test_an_integer_too_long_to_print_is_named_by_its_size_in_a_range_error():
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"model": {"tiny": {}}, "run": {"seed": 1 << 20000}})

    assert caught.value.problems == [
        "config: run.seed: Input should be less than 4294967296, got an integer of 20001 bits"
    ]


# --------------------------------------------------------------------------
# F5: names that become paths


REFUSED = {
    "\x85": "U+0085",
    "\u202e": "U+202E (RIGHT-TO-LEFT OVERRIDE)",
    "\u2028": "U+2028 (LINE SEPARATOR)",
    "\u2029": "U+2029 (PARAGRAPH SEPARATOR)",
    "\u200b": "U+200B (ZERO WIDTH SPACE)",
    "\u00a0": "U+00A0 (NO-BREAK SPACE)",
    "\t": "U+0009",
    "\U0001f600": "U+1F600 (GRINNING FACE)",
}


@pytest.mark.parametrize("character", REFUSED, ids=[f"U+{ord(c):04X}" for c in REFUSED])
def test_a_run_name_with_a_control_bidi_or_separator_character_is_refused(character):
    name = f"exp{character}1"

    problem = only_problem(None, [f"run.name={name!r}".replace("'", '"')])

    assert problem.startswith("override 'run.name=") and "': run.name: " in problem
    assert f"holds {REFUSED[character]}, which a name that becomes a directory" in problem
    assert problem.endswith(f"use {NAME_CHARACTERS}")


def test_a_run_name_with_a_leading_or_trailing_space_is_refused():
    assert "starts or ends with a space" in only_problem(None, ['run.name=" exp"'])


@pytest.mark.parametrize("name", ["hello world", "café", "実験-3", "run.2", "a,b]", "x+y=z@1"])
def test_names_of_letters_digits_spaces_and_punctuation_are_accepted(name):
    assert load_config(None, ["model.tiny={}", f"run.name={name}"]).run.name == name


@pytest.mark.parametrize("character", REFUSED, ids=[f"U+{ord(c):04X}" for c in REFUSED])
def test_a_pool_name_outside_its_character_set_is_refused_naming_the_key(tmp_path, character):
    path = config_file(tmp_path, f'generators:\n  pools:\n    - name: "fast{character}"\n')

    problem = only_problem(path)

    assert problem.startswith(f"{path}:5: generators.pools.0.name: String should match")
