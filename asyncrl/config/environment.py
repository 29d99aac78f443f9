"""The ``environment`` config section: a schema, and nothing that runs.

``Config.environment`` is None for single-turn runs; set, every sample is an
episode driven by the generator (:mod:`asyncrl.generators.episodes`). The config
schema imports this module, so it imports no environment, tool or sandbox: the
environments are built from it by :mod:`asyncrl.generation.envs.factory`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_validator

DAY_S = 24 * 3600.0
"""Upper bound of timeouts: a longer one is a mistake, and huge ones overflow rlimits and timers."""


def _not_a_bool(value: Any) -> Any:
    """YAML's `true` would pass as 1.0: a float setting wants a number."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    return value


Isolation = Literal["bubblewrap", "none"]
ISOLATIONS: tuple[str, ...] = get_args(Isolation)
"""The python tool's isolations; the sandbox (:mod:`asyncrl.generation.envs.sandbox`) knows
the same."""

Float = Annotated[float, BeforeValidator(_not_a_bool)]
"""A float setting: ints and numeric strings (YAML reads `1e-3` as one) pass, booleans do not."""


class EnvironmentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    name: str
    """`tools` for the built-in tool-calling environment, or `module:Class` /
    `path/to/file.py:Class` for your own."""
    tools: list[str] = ["calculator", "python"]
    """Tools for `name: tools`: built-in names or `module:attr` naming a Tool."""
    max_turns: StrictInt = Field(4, ge=1, le=1000)
    """Model turns per episode."""
    max_total_tokens: StrictInt = Field(2048, ge=1, le=1 << 20)
    """Tokens per episode, prompt, model turns and tool output together."""
    python_timeout_s: Float = Field(5, gt=0, le=DAY_S)
    """Wall-clock limit of one `python` tool call."""
    python_memory_mb: StrictInt = Field(512, ge=16, le=1_048_576)
    """Address-space limit of one `python` tool call."""
    python_isolation: Isolation = "bubblewrap"
    """How the `python` tool isolates model-written code: `bubblewrap` (namespaces,
    a read-only minimal filesystem, seccomp, rlimits; the launcher refuses to start
    when it cannot be set up) or `none` (a plain subprocess with rlimits: trusted
    code only). See docs/security.md."""
    formatter: Literal["chatml", "plain", "template", "auto"] = "auto"
    """How turns are rendered to text: `template` (the model's own chat template, each
    reply the template's delta after the model's turn), `chatml` (Qwen/Hermes ChatML
    written out, `<|im_start|>role ... <|im_end|>`), `plain` (`role: text` lines, for the
    tiny built-in tokenizer), or `auto` (`template` when the tokenizer has a chat
    template, else `chatml`)."""
    workers: StrictInt = Field(4, ge=1, le=1024)
    """Threads per generator that step environments (run tools), off the generation loop."""
    step_timeout_s: Float = Field(60, gt=0, le=DAY_S)
    """Wall-clock limit of one `reset` or `step` call (tools included): past it the
    episode ends with reward 0, tagged `error:environment_timeout`, and its thread
    is abandoned (a new one takes its place)."""
    kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the environment's constructor (for `tools`:
    `compute_score`, `parser`, `system_prompt`, `max_calls_per_turn`, ...)."""

    @field_validator("python_isolation", mode="before")
    @classmethod
    def _known_isolation(cls, value: Any) -> Any:
        if value not in ISOLATIONS:
            raise ValueError(
                f"python_isolation must be 'bubblewrap' (model code runs in a bubblewrap "
                f"sandbox; the default) or 'none' (no isolation, trusted code only), "
                f"got {value!r}"
            )
        return value

    @field_validator("name")
    @classmethod
    def _known_form(cls, value: str) -> str:
        if value != "tools" and ":" not in value:
            raise ValueError("expected 'tools', 'module:Class' or 'path/to/file.py:Class'")
        return value


def python_tool_limits(config: EnvironmentConfig) -> dict[str, Any] | None:
    """``timeout_s``, ``memory_mb`` and ``isolation`` of the sandbox the built-in `python`
    tool of this environment runs code in (the tools' own ``kwargs`` win, as they do
    when the environment is built); None when it has no such tool (a `module:Class`
    environment, or `tools` without `python`)."""
    if config.name != "tools":
        return None
    settings = {
        "tools": list(config.tools),
        "python_timeout_s": config.python_timeout_s,
        "python_memory_mb": config.python_memory_mb,
        **config.kwargs,
    }
    if "python" not in settings["tools"]:
        return None
    return {
        "timeout_s": settings["python_timeout_s"],
        "memory_mb": settings["python_memory_mb"],
        "isolation": config.python_isolation,
    }
