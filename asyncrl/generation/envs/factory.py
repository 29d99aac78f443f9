"""Environments by name, and the per-episode factory a generator builds from its config.

``environment.name`` is ``tools`` (the built-in :class:`ToolEnvironment`),
``module:Class`` or ``path/to/file.py:Class``; :func:`load_environment` resolves it
here, in the layer that runs environments, so that the config schema
(:mod:`asyncrl.config.environment`) stays a schema: importing it loads no environment,
tool or sandbox.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.config.environment import EnvironmentConfig, python_tool_limits
from asyncrl.generation.envs.base import Environment
from asyncrl.generation.envs.loading import PluginError, load_object
from asyncrl.generation.envs.sandbox import Sandbox
from asyncrl.generation.envs.tool_env import ToolEnvironment
from asyncrl.generation.envs.tools import python_sandbox_for, python_tool

BUILTIN_ENVIRONMENTS = {"tools": ToolEnvironment}


def load_environment(spec: str, **kwargs: Any) -> Environment:
    """A new environment: ``"tools"``, ``"module:Class"`` or ``"path/to/file.py:Class"``,
    constructed with ``kwargs``. Raises :class:`PluginError` with a readable message."""
    if spec in BUILTIN_ENVIRONMENTS:
        cls = BUILTIN_ENVIRONMENTS[spec]
    else:
        if ":" not in spec:
            raise PluginError(
                f"environment {spec!r}: expected one of {', '.join(BUILTIN_ENVIRONMENTS)}, "
                f"'module:Class' or 'path/to/file.py:Class'"
            )
        cls = load_object(spec, what="environment")
    if not isinstance(cls, type):
        raise PluginError(f"environment {spec!r} is a {type(cls).__name__}, not a class")
    if not issubclass(cls, Environment) and not (
        callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))
    ):
        raise PluginError(
            f"environment {spec!r}: {cls.__name__} neither subclasses "
            f"asyncrl.generation.envs.Environment nor has reset(row) and step(response)"
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise PluginError(
            f"environment {spec!r}: {cls.__name__}(**{sorted(kwargs)}) failed: {exc}"
        ) from exc


def environment_factory(
    config: EnvironmentConfig, *, defer_score: bool = False
) -> Callable[[], Environment]:
    """A function making a fresh environment per episode; resolves the plug-in now,
    so a bad name fails at start-up, not at the first episode.

    ``defer_score``: the built-in `tools` environment ends an episode with a
    :class:`~asyncrl.generation.envs.base.ScoreRequest` when its reward function has a name,
    for the caller's reward workers to score (the generator replica asks for this)."""
    if config.name == "tools":
        kwargs = {**_tools_kwargs(config), "defer_score": defer_score}
        sandbox = python_sandbox(config)
        if sandbox is not None:
            # One python tool, with the configured isolation, for every episode.
            tool = python_tool(sandbox=sandbox)
            kwargs["tools"] = [tool if entry == "python" else entry for entry in kwargs["tools"]]
    else:
        kwargs = dict(config.kwargs)
    load_environment(config.name, **kwargs)  # fail early
    return lambda: load_environment(config.name, **kwargs)


def _tools_kwargs(config: EnvironmentConfig) -> dict[str, Any]:
    """The constructor arguments of the built-in `tools` environment."""
    return {
        "tools": list(config.tools),
        "max_turns": config.max_turns,
        "python_timeout_s": config.python_timeout_s,
        "python_memory_mb": config.python_memory_mb,
        **config.kwargs,
    }


def python_sandbox(config: EnvironmentConfig) -> Sandbox | None:
    """The :class:`~asyncrl.generation.envs.sandbox.Sandbox` the built-in `python` tool of this
    environment runs code in (:func:`~asyncrl.config.environment.python_tool_limits`); None
    when the environment has no such tool. Building one with `python_isolation: none`
    logs the warning."""
    limits = python_tool_limits(config)
    return None if limits is None else python_sandbox_for(**limits)
