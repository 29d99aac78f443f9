"""The DAPO scorer (verl's ``math_dapo``): the text after the response's last
``Answer:``, normalised as the Minerva evaluation does, gives 1.0 when it equals the
ground truth and -1.0 otherwise (a missing answer is wrong, not neutral). Pure
functions, no imports from the rest of asyncrl, so a reward worker loads them in a
moment."""

from __future__ import annotations

import re

SOLUTION_TAIL_CHARS = 300
"""Only the response's last characters are searched (verl's bound: the longest
MATH-500 answer has 159 characters), so a long response costs no more to score."""

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_NO_ANSWER = "[INVALID]"

_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
"""Applied in order, as in verl; ``"\\ "`` (a spacing command) leaves a row break
``\\\\`` whole (see :func:`_drop_spacing_commands`)."""

_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
"""Units, filler words and LaTeX decorations deleted wherever they occur (substrings,
as in verl: ``"cm"`` goes from inside a word too)."""

_UNWRAP = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # the first $...$ and nothing around it
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # \sqrt3 -> \sqrt{3}
)

_ROW_BREAK_OR_SPACE = re.compile(r"(\\\\)|\\ ")


def _drop_spacing_commands(text: str) -> str:
    """Remove ``\\ `` but keep a row break ``\\\\`` followed by a space (verl removes the
    second backslash with the space, so ``1 \\\\ 2`` would differ from ``1\\\\2``)."""
    return _ROW_BREAK_OR_SPACE.sub(lambda match: match.group(1) or "", text)


def normalize_dapo_answer(answer: str) -> str:
    """A final answer as verl's ``math_dapo.normalize_final_answer`` writes it.

    Keeps the right-hand side of the last ``=``; applies the substitutions and
    removals above; keeps the first ``$...$``; unwraps ``\\text``, ``\\textbf``,
    ``\\overline`` and ``\\boxed``; writes ``\\frac12`` and ``\\sqrt3`` with braces;
    drops ``$``, and the commas of a number (``1,000`` -> ``1000``).
    """
    s = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = _drop_spacing_commands(s) if before == "\\ " else s.replace(before, after)
    for removed in _REMOVED:
        s = s.replace(removed, "")
    for pattern, replacement in _UNWRAP:
        s = pattern.sub(replacement, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_dapo_answer(solution_str: str) -> str | None:
    """The text after the last ``Answer:`` (any case) in the response's last
    :data:`SOLUTION_TAIL_CHARS` characters, up to the end of its line; None without one."""
    matches = _ANSWER.findall(solution_str[-SOLUTION_TAIL_CHARS:])
    return matches[-1] if matches else None


def math_dapo_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info=None
) -> float:
    """1.0 when the response's last ``Answer:`` equals the ground truth once both are
    normalised (:func:`normalize_dapo_answer`), else -1.0 (no answer included)."""
    answer = extract_dapo_answer(solution_str)
    predicted = normalize_dapo_answer(_NO_ANSWER if answer is None else answer)
    return 1.0 if predicted == normalize_dapo_answer(str(ground_truth)) else -1.0
