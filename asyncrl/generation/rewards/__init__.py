"""Reward functions, and the scorer that runs them off the generation path.

A reward function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float

and returns a number (or a dict with a ``"score"`` entry, as verl allows).
``reward.function`` names one (``module:function`` or ``path/to/file.py:function``)
for every row; left empty, each row's ``data_source`` picks a built-in from
:mod:`.sources`:

======================================================  =============================
data_source                                             scorer (reward)
======================================================  =============================
``synthetic/digits``                                    :func:`digits_score` (0..1)
``openai/gsm8k``, ``gsm8k``                             :func:`gsm8k_score` (0 or 1)
``lighteval/MATH``, ``DigitalLearningGmbH/              :func:`math_score` (0 or 1)
MATH-lighteval``, ``HuggingFaceH4/MATH-500``
``math_dapo``, ``math``, ``math_dapo_reasoning``,       :func:`math_dapo_score`
any name starting with ``aime``                         (1 or -1)
======================================================  =============================

As verl's ``default_compute_score`` resolves them (:func:`builtin_reward_function`).

The package, one job a module:

- :mod:`.builtin`: GSM8K's, MATH's and the digits task's functions, and their normalisation;
- :mod:`.math_dapo`: DAPO's ``Answer:`` scorer, and its normalisation;
- :mod:`.sources`: which built-in a ``data_source`` names;
- :mod:`.loading`: loading ``reward.function`` by name;
- :mod:`.outcome`: :class:`Score`, its error tags, what counts as a reward;
- :mod:`.scorer`: :class:`RewardScorer`, which runs functions in worker processes
  (its docstring lists what a misbehaving function costs);
- :mod:`.processes`, :mod:`.channel`, :mod:`.worker`: a worker process, the frames
  between it and the scorer, and the worker's own side.
"""

from asyncrl.generation.rewards.builtin import (
    digits_score,
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_score,
    gsm8k_score_flexible,
    math_equal,
    math_score,
    normalize_math_answer,
    normalize_number,
)
from asyncrl.generation.rewards.loading import (
    RewardFunctionError,
    check_reward_sources,
    load_reward_function,
)
from asyncrl.generation.rewards.math_dapo import (
    extract_dapo_answer,
    math_dapo_score,
    normalize_dapo_answer,
)
from asyncrl.generation.rewards.outcome import (
    ERROR_BAD_RETURN,
    ERROR_CHANNEL,
    ERROR_CRASHED,
    ERROR_EXCEPTION,
    ERROR_MEMORY,
    ERROR_NO_FUNCTION,
    ERROR_TIMEOUT,
    Score,
)
from asyncrl.generation.rewards.scorer import RewardScorer
from asyncrl.generation.rewards.sources import (
    REWARD_FUNCTIONS,
    REWARD_PREFIXES,
    RewardFunction,
    builtin_reward_function,
    known_data_sources,
    reward_range,
)

__all__ = [
    "ERROR_BAD_RETURN",
    "ERROR_CHANNEL",
    "ERROR_CRASHED",
    "ERROR_EXCEPTION",
    "ERROR_MEMORY",
    "ERROR_NO_FUNCTION",
    "ERROR_TIMEOUT",
    "REWARD_FUNCTIONS",
    "REWARD_PREFIXES",
    "RewardFunction",
    "RewardFunctionError",
    "RewardScorer",
    "Score",
    "builtin_reward_function",
    "check_reward_sources",
    "digits_score",
    "extract_boxed",
    "extract_dapo_answer",
    "extract_gsm8k_answer",
    "gsm8k_score",
    "gsm8k_score_flexible",
    "known_data_sources",
    "load_reward_function",
    "math_dapo_score",
    "math_equal",
    "math_score",
    "normalize_dapo_answer",
    "normalize_math_answer",
    "normalize_number",
    "reward_range",
]
