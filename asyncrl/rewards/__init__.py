"""Reward functions, and the scorer that runs them off the generation path.

A reward function has verl's signature::

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float

and returns a number (or a dict with a ``"score"`` entry, as verl allows).
``reward.function`` names one (``module:function`` or ``path/to/file.py:function``)
for every row; left empty, each row's ``data_source`` picks a built-in from
:data:`REWARD_FUNCTIONS`:

================================================  ===========================
data_source                                       scorer
================================================  ===========================
``synthetic/digits``                              :func:`digits_score`
``openai/gsm8k``, ``gsm8k``                       :func:`gsm8k_score` (``#### 42``)
``lighteval/MATH``, ``DigitalLearningGmbH/        :func:`math_score` (last ``\\boxed{}``)
MATH-lighteval``, ``HuggingFaceH4/MATH-500``,
``math``
================================================  ===========================

The package, one job a module:

- :mod:`.builtin`: the built-in functions and the answer normalisation they use;
- :mod:`.loading`: the registry, and loading ``reward.function`` by name;
- :mod:`.outcome`: :class:`Score`, its error tags, what counts as a reward;
- :mod:`.scorer`: :class:`RewardScorer`, which runs functions in worker processes
  (its docstring lists what a misbehaving function costs);
- :mod:`.processes`, :mod:`.channel`, :mod:`.worker`: a worker process, the frames
  between it and the scorer, and the worker's own side.
"""

from asyncrl.rewards.builtin import (
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
from asyncrl.rewards.loading import (
    REWARD_FUNCTIONS,
    RewardFunction,
    RewardFunctionError,
    check_reward_sources,
    load_reward_function,
)
from asyncrl.rewards.outcome import (
    ERROR_BAD_RETURN,
    ERROR_CHANNEL,
    ERROR_CRASHED,
    ERROR_EXCEPTION,
    ERROR_MEMORY,
    ERROR_NO_FUNCTION,
    ERROR_TIMEOUT,
    Score,
)
from asyncrl.rewards.scorer import RewardScorer

__all__ = [
    "ERROR_BAD_RETURN",
    "ERROR_CHANNEL",
    "ERROR_CRASHED",
    "ERROR_EXCEPTION",
    "ERROR_MEMORY",
    "ERROR_NO_FUNCTION",
    "ERROR_TIMEOUT",
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "RewardFunctionError",
    "RewardScorer",
    "Score",
    "check_reward_sources",
    "digits_score",
    "extract_boxed",
    "extract_gsm8k_answer",
    "gsm8k_score",
    "gsm8k_score_flexible",
    "load_reward_function",
    "math_equal",
    "math_score",
    "normalize_math_answer",
    "normalize_number",
]
