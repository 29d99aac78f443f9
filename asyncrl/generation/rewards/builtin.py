"""The built-in reward functions: GSM8K's ``####`` answers, MATH's last ``\\boxed{}``
(with the normalisation that makes equal answers compare equal), and the synthetic
digits task's positional score. Pure functions, no imports from the rest of asyncrl,
so a reward worker loads them in a moment."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

# --------------------------------------------------------------------------
# GSM8K: the number after "####"

_NUMBER = r"-?[\d,]*\.?\d+"
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")


def extract_gsm8k_answer(text: str, flexible: bool = False) -> str | None:
    """The number after the last ``####`` in ``text``, normalised; None if there is none.

    ``flexible``: with no ``####``, fall back to the last number anywhere in the text.
    """
    matches = _GSM8K_ANSWER.findall(text)
    if not matches and flexible:
        matches = re.findall(_NUMBER, text)
    return normalize_number(matches[-1]) if matches else None


def normalize_number(text: str) -> str:
    """``"$1,234.50"`` -> ``"1234.5"``: no commas, ``$`` or trailing ``.``/zeros."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return text
    if not value.is_finite():
        return text
    if value == value.to_integral_value():
        return str(value.quantize(Decimal(1)))
    return format(value.normalize(), "f")


def gsm8k_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the number after the response's last ``####`` equals the ground truth."""
    answer = extract_gsm8k_answer(solution_str)
    return float(answer is not None and answer == normalize_number(str(ground_truth)))


def gsm8k_score_flexible(
    data_source: str, solution_str: str, ground_truth: str, extra_info=None
) -> float:
    """Like :func:`gsm8k_score`, taking the last number when there is no ``####``."""
    answer = extract_gsm8k_answer(solution_str, flexible=True)
    return float(answer is not None and answer == normalize_number(str(ground_truth)))


# --------------------------------------------------------------------------
# MATH: the last \boxed{...}


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced.

    ``\\boxed 5`` (no braces) gives ``5``; None when there is no box or it is unclosed.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if rest.startswith(" "):
        match = re.match(r" +([^\s$]+)", rest)
        return match.group(1) if match else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for index, char in enumerate(rest):
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return rest[1:index]
    return None


_TEXT_COMMANDS = r"\\(?:text|textbf|textrm|mbox|mathrm)"
_SPACING_OR_ROW_BREAK = re.compile(r"(\\\\)|\\[!,;: ]")
"""A row break ``\\\\``, or a spacing command: read left to right, so the second
backslash of ``\\\\ `` (a row break, then a space) is not taken for ``\\ ``."""


def _keep_row_breaks(match: re.Match[str]) -> str:
    return match.group(1) or ""


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a MATH-style answer, so that equal answers compare equal.

    Removes spaces (and ``\\,`` ``\\;`` ``\\:`` ``\\!`` ``\\ ``, keeping a row break
    ``\\\\``), ``\\left``/``\\right``, ``$``, ``%``, degrees (``^\\circ``), a trailing
    ``.``, a unit in a trailing ``\\text{...}``, a short left-hand side (``x = 5`` ->
    ``5``), thousands separators (``1,000``);
    unwraps ``\\text{...}``; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; ``\\frac12`` ->
    ``\\frac{1}{2}``; ``\\sqrt3`` -> ``\\sqrt{3}``; ``a/b`` (integers) ->
    ``\\frac{a}{b}``; ``.5`` -> ``0.5``.
    """
    s = _SPACING_OR_ROW_BREAK.sub(_keep_row_breaks, answer.strip().replace("\n", ""))
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for degree in ("^{\\circ}", "^\\circ", "°"):
        s = s.replace(degree, "")
    for symbol in ("\\$", "$", "\\%", "%"):
        s = s.replace(symbol, "")
    unit = re.fullmatch(r"(.*\S)\s*" + _TEXT_COMMANDS + r"\{[^{}]*\}", s)
    if unit and not re.search(_TEXT_COMMANDS + r"\{", unit.group(1)):
        s = unit.group(1)  # "5 \text{ cm}" -> "5"; a whole answer "\text{(A)}" stays
    s = re.sub(_TEXT_COMMANDS + r"\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\s+", "", s)
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    fraction = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if fraction:
        s = f"\\frac{{{fraction.group(1)}}}{{{fraction.group(2)}}}"
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    s = s.rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _numeric_value(s: str) -> float | None:
    """The value of a normalised answer that is a plain number or a numeric fraction."""
    if re.fullmatch(r"-?\d+(\.\d+)?", s):
        return float(s)
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    if match and float(match.group(3)) != 0:
        value = float(match.group(2)) / float(match.group(3))
        return -value if match.group(1) else value
    return None


def math_equal(answer: str, truth: str) -> bool:
    """Equal after :func:`normalize_math_answer`, or numerically (``0.5`` == ``\\frac12``)."""
    a, b = normalize_math_answer(answer), normalize_math_answer(truth)
    if a == b:
        return True
    x, y = _numeric_value(a), _numeric_value(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


def math_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """1.0 when the response's last ``\\boxed{}`` equals the ground truth (itself boxed or not)."""
    answer = extract_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        truth = extract_boxed(truth) or truth
    return float(math_equal(answer, truth))


# --------------------------------------------------------------------------
# synthetic/digits (asyncrl.generation.tasks.DigitsTask)


def digits_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None) -> float:
    """Fraction of answer positions right, over the longer of answer and response."""
    response = solution_str.strip()
    if not response:
        return 0.0
    hits = sum(a == b for a, b in zip(response, ground_truth, strict=False))
    return hits / max(len(response), len(ground_truth))
