"""What scoring one sample gives: a :class:`Score`, its error tags, and the check that
turns whatever a reward function returned into a finite float (or says why not)."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping
from typing import Any, NamedTuple


class Score(NamedTuple):
    """A sample's reward, with ``error`` set (and ``reward`` 0.0) when scoring failed."""

    reward: float
    error: str | None = None
    detail: str = ""


ERROR_EXCEPTION = "error:exception"
ERROR_TIMEOUT = "error:timeout"
ERROR_CRASHED = "error:crashed"
"""The worker process died while scoring (the function exited, or was killed)."""
ERROR_BAD_RETURN = "error:bad_return"
"""The function returned something that is not a finite real number."""
ERROR_NO_FUNCTION = "error:no_reward_function"
"""No ``reward.function`` and no built-in for the row's ``data_source``."""
ERROR_MEMORY = "error:memory"
"""The function ran out of memory (``reward.memory_limit_mb``); its worker was replaced."""
ERROR_CHANNEL = "error:channel"
"""The worker sent something that is not a reply (the function wrote to the worker's
channel); the worker was replaced."""

WORKER_ERRORS = frozenset({ERROR_EXCEPTION, ERROR_BAD_RETURN, ERROR_NO_FUNCTION, ERROR_MEMORY})
"""The tags a worker may put in a reply; any other makes the reply invalid."""

DETAIL_CHARS = 500
_REPR_CHARS = 200


def clip(text: str, limit: int = DETAIL_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = _REPR_CHARS
_REPR.maxlevel = 3


def short_repr(value: Any) -> str:
    """``repr`` cut to ~200 characters without building the whole of a huge str, list or dict
    (nor failing on an int too long to print)."""
    try:
        return clip(_REPR.repr(value), _REPR_CHARS)
    except Exception:
        return f"<{type(value).__name__} object>"


def describe(error: BaseException) -> str:
    """``Type: message``, clipped; an exception whose ``str`` fails still gets its type."""
    try:
        message = str(error)
    except Exception:
        message = "<unprintable>"
    name = type(error).__name__
    return clip(f"{name}: {clip(message, 2 * DETAIL_CHARS)}" if message else name)


def to_reward(value: Any) -> float:
    """``value`` as a reward: a finite real number (verl's ``{"score": x}`` too).

    Booleans (numpy's as well), numeric strings, None and containers are not
    rewards: taking them would hide a function that returns the wrong thing.
    """
    if isinstance(value, Mapping) and "score" in value:
        value = value["score"]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"a {type(value).__name__} is not a real number")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"{reward} is not finite")
    return reward
