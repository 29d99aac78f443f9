"""Multi-turn environments: tool calls, sandboxed tools, and the rollout driver.

See ``docs/environments.md``. The pieces, one job each:

- :mod:`.base`: the :class:`Environment` API, :class:`StepResult`, :class:`ScoreRequest`;
- :mod:`.tool_calls`: parsing ``<tool_call>`` JSON out of a model turn;
- :mod:`.tools`, :mod:`.calculator`, :mod:`.sandbox`: tools and their limits;
- :mod:`.tool_env`: the built-in :class:`ToolEnvironment`;
- :mod:`.formatting`: turn formatters and the text/token codec;
- :mod:`.rollout`: the driver that builds the one token sequence;
- :mod:`.threads`: the threads environments run on, which a stuck call may leave;
- :mod:`.loading`, :mod:`.factory`: plug-ins by name, environments built from config.

The config section is :mod:`asyncrl.config.environment`, with the rest of the schema.

Names are imported from their modules on first use, so that importing one module
(the built-in tool environment) does not load the others (the sandbox).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.generation.envs.base import Environment, Message, ScoreRequest, StepResult
    from asyncrl.generation.envs.factory import (
        BUILTIN_ENVIRONMENTS,
        environment_factory,
        load_environment,
    )
    from asyncrl.generation.envs.formatting import (
        ChatMLFormatter,
        Codec,
        PlainTextFormatter,
        TurnFormatter,
    )
    from asyncrl.generation.envs.loading import PluginError, load_object
    from asyncrl.generation.envs.rollout import EpisodeRunner, Trajectory, TurnRequest, run_episode
    from asyncrl.generation.envs.sandbox import (
        Sandbox,
        SandboxResult,
        SandboxUnavailable,
        check_isolation,
        check_isolation_for,
    )
    from asyncrl.generation.envs.threads import StepPool
    from asyncrl.generation.envs.tool_calls import (
        HermesToolCallParser,
        ParsedTurn,
        ToolCall,
        ToolCallError,
        ToolCallParser,
    )
    from asyncrl.generation.envs.tool_env import ToolEnvironment
    from asyncrl.generation.envs.tools import Tool, ToolError

_EXPORTS = {
    "Environment": "base",
    "Message": "base",
    "ScoreRequest": "base",
    "StepResult": "base",
    "BUILTIN_ENVIRONMENTS": "factory",
    "check_isolation_for": "sandbox",
    "environment_factory": "factory",
    "load_environment": "factory",
    "ChatMLFormatter": "formatting",
    "Codec": "formatting",
    "PlainTextFormatter": "formatting",
    "TurnFormatter": "formatting",
    "PluginError": "loading",
    "load_object": "loading",
    "EpisodeRunner": "rollout",
    "Trajectory": "rollout",
    "TurnRequest": "rollout",
    "run_episode": "rollout",
    "Sandbox": "sandbox",
    "SandboxResult": "sandbox",
    "SandboxUnavailable": "sandbox",
    "check_isolation": "sandbox",
    "StepPool": "threads",
    "HermesToolCallParser": "tool_calls",
    "ParsedTurn": "tool_calls",
    "ToolCall": "tool_calls",
    "ToolCallError": "tool_calls",
    "ToolCallParser": "tool_calls",
    "ToolEnvironment": "tool_env",
    "Tool": "tools",
    "ToolError": "tools",
}
"""Each public name and the submodule that defines it."""


def __getattr__(name: str) -> Any:
    """``asyncrl.generation.envs.X``: import the submodule that defines ``X`` now, once."""
    submodule = _EXPORTS.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "ChatMLFormatter",
    "Codec",
    "Environment",
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
