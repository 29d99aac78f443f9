"""Multi-turn environments: tool calls, sandboxed tools, and the rollout driver.

See ``docs/environments.md``. The pieces, one job each:

- :mod:`.base`: the :class:`Environment` API, :class:`StepResult`, :class:`ScoreRequest`;
- :mod:`.tool_calls`: parsing ``<tool_call>`` JSON out of a model turn;
- :mod:`.tools`, :mod:`.calculator`, :mod:`.sandbox`: tools and their limits;
- :mod:`.tool_env`: the built-in :class:`ToolEnvironment`;
- :mod:`.formatting`: turn formatters and the text/token codec;
- :mod:`.rollout`: the driver that builds the one token sequence;
- :mod:`.threads`: the threads environments run on, which a stuck call may leave;
- :mod:`.loading`, :mod:`.config`: plug-ins by name, the config section.
"""

from __future__ import annotations

from typing import Any

from asyncrl.envs.base import Environment, Message, ScoreRequest, StepResult
from asyncrl.envs.config import EnvironmentConfig, environment_factory
from asyncrl.envs.formatting import ChatMLFormatter, Codec, PlainTextFormatter, TurnFormatter
from asyncrl.envs.loading import PluginError, load_object
from asyncrl.envs.rollout import EpisodeRunner, Trajectory, TurnRequest, run_episode
from asyncrl.envs.sandbox import (
    Sandbox,
    SandboxResult,
    SandboxUnavailable,
    check_isolation,
    check_isolation_for,
)
from asyncrl.envs.threads import StepPool
from asyncrl.envs.tool_calls import (
    HermesToolCallParser,
    ParsedTurn,
    ToolCall,
    ToolCallError,
    ToolCallParser,
)
from asyncrl.envs.tool_env import ToolEnvironment
from asyncrl.envs.tools import Tool, ToolError

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
            f"asyncrl.envs.Environment nor has reset(row) and step(response)"
        )
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise PluginError(
            f"environment {spec!r}: {cls.__name__}(**{sorted(kwargs)}) failed: {exc}"
        ) from exc


__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ChatMLFormatter",
    "Codec",
    "Environment",
    "EnvironmentConfig",
    "EpisodeRunner",
    "HermesToolCallParser",
    "Message",
    "ParsedTurn",
    "PlainTextFormatter",
    "PluginError",
    "Sandbox",
    "SandboxResult",
    "SandboxUnavailable",
    "ScoreRequest",
    "StepPool",
    "StepResult",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolError",
    "Trajectory",
    "TurnFormatter",
    "TurnRequest",
    "check_isolation",
    "check_isolation_for",
    "environment_factory",
    "load_environment",
    "load_object",
    "run_episode",
]
