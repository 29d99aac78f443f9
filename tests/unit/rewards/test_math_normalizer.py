"""MATH answers with LaTeX row breaks: ``\\\\`` is part of the answer (a matrix's rows),
not a spacing command, however it is spaced."""

from __future__ import annotations

import pytest

from asyncrl.generation.rewards import math_equal, math_score, normalize_math_answer

COLUMN = r"\begin{pmatrix}1\\2\end{pmatrix}"


@pytest.mark.parametrize(
    "answer, normalised",
    [
        (r"1 \\ 2", r"1\\2"),  # the issue: this gave 1\2
        (r"1\\ 2", r"1\\2"),
        (r"1 \\2", r"1\\2"),
        (r"1\\\,2", r"1\\2"),  # a row break, then a thin space
        (r"1\\,2", r"1\\,2"),  # a row break, then a comma (no thin space in it)
        (r"1\ 2\,3\;4\:5\!6", "123456"),  # the spacing commands still go
        (r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", COLUMN),
    ],
)
def test_a_row_break_survives_normalisation(answer, normalised):
    assert normalize_math_answer(answer) == normalised


def test_a_spaced_column_vector_scores_as_the_same_one_written_tight():
    response = r"So the vector is $\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}$."
    assert math_score("HuggingFaceH4/MATH-500", response, COLUMN) == 1.0
    assert math_score("HuggingFaceH4/MATH-500", response, rf"\boxed{{{COLUMN}}}") == 1.0


@pytest.mark.parametrize(
    "answer, truth, equal",
    [
        (
            r"\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}",
            r"\begin{pmatrix}1&0\\0&1\end{pmatrix}",
            True,
        ),
        (
            r"\begin{pmatrix} -3 \\ \frac{1}{2} \end{pmatrix}",
            r"\begin{pmatrix}-3\\\frac12\end{pmatrix}",
            True,
        ),
        (r"\begin{pmatrix} 1 \\ 3 \end{pmatrix}", COLUMN, False),  # another vector
        (r"\begin{pmatrix} 1 & 2 \end{pmatrix}", COLUMN, False),  # a row is not a column
        (r"\begin{pmatrix} 12 \end{pmatrix}", COLUMN, False),  # the break is not dropped
    ],
)
def test_matrices_compare_by_their_entries_and_rows(answer, truth, equal):
    assert math_equal(answer, truth) is equal
