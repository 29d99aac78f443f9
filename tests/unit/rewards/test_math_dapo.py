"""The DAPO scorer (verl's ``math_dapo``): the text after the last ``Answer:``, normalised
as the Minerva evaluation does; 1.0 when right, -1.0 when wrong or missing. The
normalisations below are worked by hand from verl's rules, quirks included."""

from __future__ import annotations

import pytest

from asyncrl.generation.rewards import extract_dapo_answer, math_dapo_score, normalize_dapo_answer


@pytest.mark.parametrize(
    "answer, normalised",
    [
        ("42", "42"),
        (" 1,000 ", "1000"),  # spaces go, then a number's commas
        ("1,2", "12"),  # verl: "1,2" is a number once its commas go
        ("(1, 2)", "(1,2)"),  # not a number: the comma stays
        ("x = 5", "5"),  # the right of the last "="
        ("$1,000$", "1000"),
        ("The answer is $7$ cm.", "7"),  # the first $...$ only
        ("12 students", "12"),  # units and filler words go
        (r"\frac12", r"\frac{1}{2}"),
        (r"\dfrac12", r"\dfrac{1}{2}"),  # \dfrac is not made \frac
        (r"\sqrt3", r"\sqrt{3}"),
        (r"\boxed{7}", "7"),
        (r"\text{(B)}", "(B)"),
        (r"\textbf{5}", "5"),
        (r"\overline{3}", "3"),
        (r"90^\circ", "90"),
        (r"\$18", "18"),
        ("banana split", "banansplit"),  # "a " goes wherever it is, as in verl
        (r"1 \\ 2", r"1\\2"),  # a row break stays whole (verl gives 1\2)
    ],
)
def test_normalisation(answer, normalised):
    assert normalize_dapo_answer(answer) == normalised


def test_the_answer_is_after_the_last_answer_marker_to_the_end_of_its_line():
    assert extract_dapo_answer("so...\nAnswer: 3\nthen\nanswer:  42 \nok") == "42 "
    assert extract_dapo_answer("ANSWER:\n17") == "17"  # the space after ":" may be a newline
    assert extract_dapo_answer("the answer is 42") is None
    assert extract_dapo_answer("Answer: 42\n" + "x" * 300) is None  # only the last 300 chars
    assert extract_dapo_answer("Answer: 42\n" + "x" * 289) == "42"  # 11 + 289 = 300


@pytest.mark.parametrize(
    "response, truth, reward",
    [
        ("2 + 40 = 42.\nAnswer: 42", "42", 1.0),
        ("answer: 42", "42", 1.0),
        (r"Final Answer: $\boxed{42}$", "42", 1.0),
        ("Answer: x = 42", "42", 1.0),
        ("Answer: 42", 42, 1.0),  # a ground truth that is a number
        ("Answer: 3\nAnswer: 42", "42", 1.0),  # the last marker counts
        ("Answer: 42\nAnswer: 3", "42", -1.0),
        ("Answer: 41", "42", -1.0),  # wrong: -1, not 0
        ("the answer is 42", "42", -1.0),  # no marker: wrong too
        ("", "42", -1.0),
        ("Answer: 42\n" + "x" * 300, "42", -1.0),  # the marker is past the tail
        (r"Answer: \begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix}1\\2\end{pmatrix}", 1.0),
    ],
)
def test_math_dapo_score(response, truth, reward):
    assert math_dapo_score("math_dapo", response, truth, None) == reward
