"""The child's side of :mod:`asyncrl.generation.plugin_check`: the only place the user's reward and
environment modules are imported for checking, in the contained child that
:func:`asyncrl.generation.contained.run_contained` starts (never in the command's process).

Each check is announced (``["start", index]``, which starts its deadline) and answered
(``["end", index, problem or None, value]``); an exception in one is its problem, and
the next check still runs."""

from __future__ import annotations

from typing import Any

# imported before the child says it is ready: asyncrl's own start-up is not the user's time
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.generation.envs.factory import environment_factory
from asyncrl.generation.plugin_check import ACTIONS, clip
from asyncrl.generation.rewards.loading import RewardFunctionError, load_reward_function
from asyncrl.generation.rewards.worker import score_one


def child_checks(request: dict, send) -> None:
    """Run each check, announcing it first (its deadline starts then) and answering after."""
    functions: dict[str, Any] = {}
    memory_limit_mb = request["memory_limit_mb"]
    for index, (kind, subject, args) in enumerate(request["checks"]):
        send(["start", index])
        try:
            problem, value = _CHILD_STEPS[kind](subject, args, functions)
        except MemoryError:
            problem, value = f"{subject}: ran out of memory: {_memory(memory_limit_mb)}", None
        except BaseException as error:  # SystemExit too: the next check still runs
            problem, value = f"{subject}: {ACTIONS[kind]} raised {_describe(error)}", None
        send(["end", index, problem, value])


def _load_reward(subject: str, args: list, functions: dict) -> tuple[str | None, Any]:
    try:
        functions[subject] = load_reward_function(subject)
    except RewardFunctionError as error:
        if isinstance(error.__cause__, MemoryError):
            raise MemoryError from None
        return str(error), None
    return None, None


def _build_environment(subject: str, args: list, functions: dict) -> tuple[str | None, Any]:
    config = EnvironmentConfig.model_validate(args[0])
    try:
        built = environment_factory(config, defer_score=True)()
    except (ValueError, OSError) as error:  # a PluginError, a bad argument: it says what
        return clip(str(error)), None
    score_function = getattr(built, "score_function", None)
    return None, score_function if isinstance(score_function, str) else None


def _score(subject: str, args: list, functions: dict) -> tuple[str | None, Any]:
    function = functions.get(subject)
    if function is None:
        return None, None  # it did not load: that check said so
    return None, list(score_one(function, tuple(args)))


_CHILD_STEPS = {"reward": _load_reward, "environment": _build_environment, "score": _score}


def _describe(error: BaseException) -> str:
    return clip(f"{type(error).__name__}: {error}")


def _memory(memory_limit_mb: int) -> str:
    return (
        f"an allocation went past reward.memory_limit_mb={memory_limit_mb} "
        "(raise it for a module that imports a large library)"
    )
