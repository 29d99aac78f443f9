"""The quickstart's task: a reward in [0, 1] that depends on the prompt.

The promise that makes the quickstart meaningful: learning it needs the
prompt, because no single fixed output scores above 0.2 on average. Checked
exhaustively over every fixed digit string of up to the answer's length, on
the prompts the task really draws.
"""

from __future__ import annotations

import itertools

import pytest

from asyncrl.config import TaskConfig
from asyncrl.generation.tasks import DigitsTask, build_tokenizer, digits_score

SOURCE = "synthetic/digits"


def digit_strings(task: DigitsTask, count: int) -> list[str]:
    """The digits of the task's first ``count`` prompts (the text without its ``=``)."""
    return [task.prompt(index).text[:-1] for index in range(count)]


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("483", "483", 1.0),  # 372= -> 483
        ("482", "483", 2 / 3),
        ("384", "483", 1 / 3),  # the right digits in the wrong places
        ("", "483", 0.0),
        ("  483\n", "483", 1.0),  # surrounding whitespace is not part of the answer
        ("48", "483", 2 / 3),  # too short: the missing position is wrong
        ("483000", "483", 0.5),  # too long: padding dilutes the score
    ],
)
def test_score_is_the_fraction_of_answer_positions_right(response, answer, score):
    assert digits_score(SOURCE, response, answer) == pytest.approx(score)


def test_answer_adds_the_shift_to_each_digit_mod_10():
    task = DigitsTask(TaskConfig(num_digits=3, shift=1), seed=0)
    assert task.make_prompt(7, "372").ground_truth == "483"
    assert task.make_prompt(7, "909").ground_truth == "010"
    shifted = DigitsTask(TaskConfig(num_digits=2, shift=7), seed=0)
    assert shifted.make_prompt(0, "38").ground_truth == "05"


def test_prompts_are_a_function_of_seed_and_index():
    config = TaskConfig(num_digits=3, shift=1)
    first, again = DigitsTask(config, seed=5), DigitsTask(config, seed=5)
    assert [first.prompt(i) for i in range(50)] == [again.prompt(i) for i in range(50)]
    assert digit_strings(first, 50) != digit_strings(DigitsTask(config, seed=6), 50)


def test_no_fixed_output_scores_above_0_2_on_average():
    task = DigitsTask(TaskConfig(num_digits=3, shift=1), seed=1)
    answers = [task.prompt(index).ground_truth for index in range(2000)]
    assert len(set(answers)) > 800  # the prompts really vary

    best_score, best_output = 0.0, ""
    for length in (1, 2, 3):
        for output in map("".join, itertools.product("0123456789", repeat=length)):
            score = sum(digits_score(SOURCE, output, answer) for answer in answers) / len(answers)
            if score > best_score:
                best_score, best_output = score, output
    assert best_score <= 0.2, (best_output, best_score)
    # ... while answering each prompt right scores 1
    assert all(digits_score(SOURCE, answer, answer) == 1.0 for answer in answers)


def test_excluded_prompts_are_never_drawn_and_the_stream_stays_deterministic():
    config = TaskConfig(num_digits=2, shift=1)
    plain = DigitsTask(config, seed=3)
    held_out = set(digit_strings(plain, 10))
    task = DigitsTask(config, seed=3, exclude=held_out)
    drawn = digit_strings(task, 500)
    assert held_out.isdisjoint(drawn)
    assert drawn == digit_strings(DigitsTask(config, seed=3, exclude=held_out), 500)
    with pytest.raises(ValueError, match="every 2-digit prompt is excluded"):
        DigitsTask(config, seed=3, exclude={f"{n:02d}" for n in range(100)})


def test_prompt_encodes_to_bos_then_one_token_per_character():
    tokenizer = build_tokenizer()
    task = DigitsTask(TaskConfig(num_digits=3, shift=1), seed=0)
    prompt = task.make_prompt(0, "372")
    ids = task.encode_prompt(prompt, tokenizer)
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len("372=")
    assert tokenizer.decode(ids[1:]) == "372="
