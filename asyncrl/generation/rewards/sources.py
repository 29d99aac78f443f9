"""Which built-in reward function scores a row, by its ``data_source``, resolved as
verl's ``default_compute_score`` resolves it (exact names, then ``aime...``), with
asyncrl's own names (``synthetic/digits``, ``gsm8k``) besides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.generation.rewards.builtin import digits_score, gsm8k_score, math_score
from asyncrl.generation.rewards.math_dapo import math_dapo_score

RewardFunction = Callable[[str, str, str, Any], Any]
"""``(data_source, solution_str, ground_truth, extra_info) -> float`` (or ``{"score": x}``)."""

REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "synthetic/digits": digits_score,
    "openai/gsm8k": gsm8k_score,
    "gsm8k": gsm8k_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
    "math_dapo": math_dapo_score,
    "math": math_dapo_score,
    "math_dapo_reasoning": math_dapo_score,
}
"""Built-in reward functions by exact ``data_source``, used when ``reward.function`` is
empty (``math`` is DAPO's, as in verl, not MATH's ``\\boxed{}`` scorer)."""

REWARD_PREFIXES: dict[str, RewardFunction] = {"aime": math_dapo_score}
"""Built-ins for every ``data_source`` that starts with the key (``aime2024``, ...)."""

REWARD_RANGES: dict[RewardFunction, tuple[float, float]] = {math_dapo_score: (-1.0, 1.0)}
"""The rewards a built-in gives, when not within 0..1: the config's ``reward.min``..
``reward.max`` must hold them, or the buffer refuses the samples."""


def builtin_reward_function(data_source: Any) -> RewardFunction | None:
    """The built-in that scores ``data_source``: an exact name first, then a prefix;
    None when there is none (a row that then needs ``reward.function``)."""
    if not isinstance(data_source, str):
        return None
    function = REWARD_FUNCTIONS.get(data_source)
    if function is not None:
        return function
    for prefix, prefixed in REWARD_PREFIXES.items():
        if data_source.startswith(prefix):
            return prefixed
    return None


def reward_range(function: RewardFunction) -> tuple[float, float]:
    """The lowest and highest reward a built-in gives."""
    return REWARD_RANGES.get(function, (0.0, 1.0))


def known_data_sources() -> str:
    """The names that have a built-in, for messages: ``aime*, gsm8k, math, ...``."""
    names = [*REWARD_FUNCTIONS, *(f"{prefix}*" for prefix in REWARD_PREFIXES)]
    return ", ".join(sorted(names))
