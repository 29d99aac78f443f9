"""Check the user's plug-ins (reward functions, environments) without importing them here.

:mod:`asyncrl.run.preflight` and :class:`~asyncrl.generation.rewards.RewardScorer` need to know
whether ``reward.function`` loads, whether the environment builds (and which
reward function it names), and what a function gives on a few rows. Each
answer needs the user's module imported, and importing runs its code: in the
command's own process a module that hangs, allocates gigabytes, stops its
parent or leaves a daemon behind did all that to ``asyncrl validate`` itself.
So :func:`run_checks` does the work in a contained child
(:func:`asyncrl.generation.contained.run_contained`): an import or an environment's building
must finish within ``reward.load_timeout_s``, a call to score within
``reward.timeout_s``, the child runs under ``reward.memory_limit_mb``, and
whatever happens the child and every process it started are gone when the
answers come back::

    outcomes = run_checks([Check("reward", "my_rewards.py:score")], timeout_s=10,
                          load_timeout_s=60, memory_limit_mb=4096)
    outcomes[0].problem   # None, or one line: "importing it did not finish within ..."
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.generation.contained import ContainedError, run_contained

CHILD_ENTRY = "asyncrl.generation.plugin_check_child:child_checks"
"""What the child runs (named, not imported: only the child imports the user's modules)."""
ERROR_TIMEOUT = "error:timeout"
ERROR_CRASHED = "error:crashed"
_DETAIL_CHARS = 400
ACTIONS = {"reward": "importing it", "environment": "building it", "score": "scoring"}


@dataclass(frozen=True)
class Check:
    """One question for the child.

    ``reward``: load the function ``subject`` names. ``environment``: build the
    environment whose section (as JSON data) is ``args[0]``; its outcome's value is
    the name of its own reward function, or None. ``score``: call the function
    ``subject`` (loaded by an earlier ``reward`` check) on ``args``
    ``(data_source, solution_str, ground_truth, extra_info)``; its outcome's value is
    ``[reward, error tag or None, detail]``, or None when the function did not load.
    """

    kind: Literal["reward", "environment", "score"]
    subject: str
    args: tuple = ()


@dataclass(frozen=True)
class Outcome:
    problem: str | None = None
    """One line on why the check failed; None when it did not."""
    value: Any = None


def run_checks(
    checks: list[Check], *, timeout_s: float, load_timeout_s: float, memory_limit_mb: int
) -> list[Outcome]:
    """An outcome per check, in order, from one contained child. A check that hangs (no
    answer within ``timeout_s`` for a score, ``load_timeout_s`` for an import or a build)
    or kills the child fails with that, and the checks after it are not run (their
    outcome is an empty :class:`Outcome`)."""
    request = {
        "memory_limit_mb": memory_limit_mb,
        "checks": [[check.kind, check.subject, list(check.args)] for check in checks],
    }

    def due(previous: Any) -> float:
        """The time the child has for its next message: a started check's own limit."""
        match previous:
            case ["start", int() as index] if 0 <= index < len(checks):
                return limit_of(checks[index], timeout_s, load_timeout_s)
        return timeout_s

    try:
        messages = run_contained(
            CHILD_ENTRY, request, timeout_s=due, memory_limit_mb=memory_limit_mb
        )
        failure = None
    except ContainedError as error:
        messages, failure = error.messages, error
    outcomes = [Outcome() for _ in checks]
    running: int | None = 0 if checks else None
    for message in messages:
        match message:
            case ["start", int() as index] if 0 <= index < len(checks):
                running = index
            case ["end", int() as index, None | str() as problem, value] if (
                0 <= index < len(checks)
            ):
                outcomes[index] = Outcome(problem and clip(problem), value)
                running = None
    if failure is not None and running is not None:
        check = checks[running]
        outcomes[running] = _failed(check, failure, limit_of(check, timeout_s, load_timeout_s))
    return outcomes


def limit_of(check: Check, timeout_s: float, load_timeout_s: float) -> float:
    return timeout_s if check.kind == "score" else load_timeout_s


def _failed(check: Check, failure: ContainedError, timeout_s: float) -> Outcome:
    """The outcome of the check the child was on when it hung or died."""
    stopped = "it was stopped, with every process it started"
    if check.kind == "score":
        if failure.timed_out:
            return Outcome(None, [0.0, ERROR_TIMEOUT, f"no reward after {timeout_s}s; {stopped}"])
        ended = f"the reward worker {failure.ended}" if failure.ended else failure.reason
        return Outcome(None, [0.0, ERROR_CRASHED, f"{ended}; {stopped}"])
    action = ACTIONS[check.kind]
    if failure.timed_out:
        what = f"{action} did not finish within reward.load_timeout_s={timeout_s:g} s"
    else:
        what = f"{action} failed: {failure.reason}"
    return Outcome(f"{check.subject}: {what}; {stopped}")


def check_reward_function(spec: str, *, load_timeout_s: float, memory_limit_mb: int) -> None:
    """Raise :class:`~asyncrl.generation.rewards.RewardFunctionError` when ``spec`` does not load (a
    bad name, a module that raises, hangs, crashes or runs out of memory at import)."""
    from asyncrl.generation.rewards.loading import RewardFunctionError

    (outcome,) = run_checks(
        [Check("reward", spec)],
        timeout_s=load_timeout_s,
        load_timeout_s=load_timeout_s,
        memory_limit_mb=memory_limit_mb,
    )
    if outcome.problem is not None:
        raise RewardFunctionError(outcome.problem)


def clip(text: str) -> str:
    """``text`` on one line, cut to a few hundred characters."""
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 1] + "…"
