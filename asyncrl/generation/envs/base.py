"""The environment API: start from a dataset row, answer each model turn.

An :class:`Environment` runs one episode at a time (make one per concurrent
episode)::

    messages = env.reset(row)        # the chat messages that make the prompt
    result = env.step(model_text)    # after each model turn
    # result.done: the episode is over and result.reward scores it (plus the
    # score of result.score_request, when there is one);
    # otherwise result.messages (role "tool" or "user") go back to the model.

``row`` is one dataset row in the verl layout (``prompt`` as chat messages,
``data_source``, ``reward_model.ground_truth``, ``extra_info``), or whatever a
custom environment expects. ``model_text`` is the decoded text of the turn,
without the turn's end marker. Environments deal only in text: the rollout
driver (:mod:`asyncrl.generation.envs.rollout`) owns the tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]
"""A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``
(tool messages may carry ``"name"``)."""


@dataclass(frozen=True)
class ScoreRequest:
    """An episode's final answer, for a reward function named by ``module:function``
    (or ``path/to/file.py:function``) to score.

    An environment that returns one (``StepResult(done=True, score_request=...)``)
    instead of calling the function itself lets the driver decide where it runs:
    in a generator replica, the replica's reward workers score it in their own
    processes with ``reward.timeout_s`` (:class:`asyncrl.generation.rewards.RewardScorer`), so
    a reward function that hangs or crashes costs one sample, never an environment
    thread; :func:`asyncrl.generation.envs.rollout.run_episode` calls it in place.
    """

    function: str
    """``module:function`` or ``path/to/file.py:function``, with verl's signature
    ``(data_source, solution_str, ground_truth, extra_info) -> float | {"score": ...}``."""
    solution_str: str
    data_source: str = ""
    ground_truth: Any = None
    extra_info: Any = None

    def score_here(self) -> float:
        """Call the function in this thread (drivers without reward workers)."""
        from asyncrl.generation.rewards import load_reward_function

        function = load_reward_function(self.function)
        value = function(self.data_source, self.solution_str, self.ground_truth, self.extra_info)
        if isinstance(value, Mapping):  # verl lets a scorer return {"score": ..., ...}
            value = value["score"]
        return float(value)


@dataclass
class StepResult:
    messages: list[Message] = field(default_factory=list)
    """What the environment says back (tool results, feedback); ignored when done."""
    done: bool = False
    reward: float = 0.0
    """Added to the episode's reward; most environments give one at the end."""
    tool_calls: int = 0
    """Tool calls the model attempted this turn, malformed ones included."""
    tool_errors: int = 0
    """Of those, how many could not be carried out (bad call, unknown tool, bad
    arguments, a tool that raised)."""
    info: dict[str, Any] = field(default_factory=dict)
    score_request: ScoreRequest | None = None
    """With ``done``: the final answer, scored by a named reward function; its score
    is added to ``reward``. Ignored when the episode goes on."""


class Environment(ABC):
    """Subclass and implement :meth:`reset` and :meth:`step`."""

    @abstractmethod
    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """Start an episode from ``row``; return the messages that make the prompt."""

    @abstractmethod
    def step(self, response: str) -> StepResult:
        """The model said ``response``: end the episode or answer it."""

    def truncated_reward(self, finish_reason: str) -> float:
        """Reward added when the driver ends the episode for a limit
        (``finish_reason`` ``"length"`` or ``"max_turns"``) before the
        environment did. Default 0."""
        return 0.0


def prompt_messages(row: Mapping[str, Any]) -> list[Message]:
    """The chat messages of a verl-style row: ``prompt`` as messages or as a string."""
    prompt = row.get("prompt", "")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(message) for message in prompt]


def ground_truth(row: Mapping[str, Any]) -> Any:
    """``row["reward_model"]["ground_truth"]``, or ``row["ground_truth"]``."""
    reward_model = row.get("reward_model") or {}
    if isinstance(reward_model, Mapping) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    return row.get("ground_truth")
