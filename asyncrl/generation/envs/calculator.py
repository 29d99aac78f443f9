"""Safe arithmetic: parse with :mod:`ast`, walk a whitelist of nodes, never ``eval``.

``calculate("2 * (3 + 4) ** 2")`` -> ``"98"``. Numbers, ``+ - * / // % **``,
unary signs, the constants ``pi e tau inf``, and a few functions from
:mod:`math` (``sqrt log exp sin ...``, ``abs round min max``). Anything else
(names, attributes, comprehensions, strings) is a :class:`CalculatorError`.
Sizes are bounded so no expression can hang or exhaust memory: exponents and
factorials are capped and no integer may grow past ``MAX_INT_BITS``.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096
MAX_EXPONENT = 1000
MAX_FACTORIAL = 500


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message says why."""


def _factorial(n: float) -> int:
    if not float(n).is_integer() or n < 0 or n > MAX_FACTORIAL:
        raise CalculatorError(f"factorial needs a whole number in 0..{MAX_FACTORIAL}")
    return math.factorial(int(n))


FUNCTIONS: dict[str, Callable[..., float]] = {
    "sqrt": math.sqrt,
    "exp": math.exp,
    "log": math.log,
    "log2": math.log2,
    "log10": math.log10,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "atan2": math.atan2,
    "floor": math.floor,
    "ceil": math.ceil,
    "abs": abs,
    "round": round,
    "min": min,
    "max": max,
    "factorial": _factorial,
    "gcd": math.gcd,
}
CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf}


def _power(base, exponent):
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent too large (limit {MAX_EXPONENT})")
    if (
        isinstance(base, int)
        and isinstance(exponent, int)
        and base.bit_length() * exponent > MAX_INT_BITS
    ):
        raise CalculatorError("result too large")
    return operator.pow(base, exponent)


BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: _power,
}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _check(value):
    if isinstance(value, complex):
        raise CalculatorError("complex results are not supported")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError("result too large")
    return value


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _check(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return _check(UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r}")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        function = FUNCTIONS.get(node.func.id)
        if function is None:
            raise CalculatorError(f"unknown function {node.func.id!r}")
        if node.keywords:
            raise CalculatorError("keyword arguments are not supported")
        return _check(function(*[_evaluate(arg) for arg in node.args]))
    raise CalculatorError(f"{type(node).__name__} is not allowed in an expression")


def calculate(expression: str) -> str:
    """Evaluate ``expression``; the result as text (floats to 15 significant digits)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid expression: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression nested too deeply") from None
    try:
        value = _evaluate(tree)
    except CalculatorError:
        raise
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
    except (ArithmeticError, ValueError, TypeError) as exc:
        raise CalculatorError(f"{type(exc).__name__}: {exc}") from None
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.15g}"
    return str(value)
