"""The built-in tool-calling environment.

``ToolEnvironment(["calculator", "python"], compute_score=my_score)``:

- ``reset(row)``: the row's prompt messages, behind a system message that
  lists the tools' JSON schemas and the ``<tool_call>`` format (the wording of
  the Qwen2.5/Hermes chat templates). A system message already in the row
  comes first and the tool listing is added to it.
- ``step(text)``: tool calls in the turn are run in order and their outputs
  (or error messages: malformed call, unknown tool, bad arguments, a tool that
  raised) go back as ``tool`` messages; the episode continues. A turn with no
  tool call is the final answer: the episode ends, scored by
  ``compute_score(data_source, solution_str, ground_truth, extra_info)``
  (verl's signature; ``solution_str`` is that last turn's text).

With ``defer_score=True`` (what the generator replica asks for) a reward
function that has a name (the default, or ``compute_score="module:function"``)
is not called in ``step``: the final :class:`StepResult` carries a
:class:`ScoreRequest` and the replica's reward workers score it in their own
processes, with ``reward.timeout_s``. A Python callable has no name another
process could load, so it is always called in ``step``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from asyncrl.generation.envs.base import (
    Environment,
    Message,
    ScoreRequest,
    StepResult,
    ground_truth,
    prompt_messages,
)
from asyncrl.generation.envs.tool_calls import ToolCall, ToolCallError, ToolCallParser, make_parser
from asyncrl.generation.envs.tools import Tool, ToolError, build_tools

ComputeScore = Callable[[str, str, Any, Any], "float | Mapping[str, Any]"]

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
DEFAULT_SCORE = "asyncrl.generation.envs.tool_env:default_score"
"""The name of :func:`default_score`, for reward workers to load."""
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{schemas}
</tools>

For each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""
"""The tool listing of the system message (the Qwen2.5/Hermes templates' wording);
``{schemas}`` stands for the tools' JSON schemas, one per line."""


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def default_score(data_source: str, solution_str: str, ground_truth: Any, extra_info=None) -> float:
    """The built-in reward function of ``data_source`` (asyncrl.generation.rewards, e.g. GSM8K's
    ``#### answer``) when there is one; otherwise 1.0 when the answer (the last
    ``\\boxed{...}``, else the whole text) equals the ground truth, numerically when
    both are numbers, else 0.0."""
    from asyncrl.generation.rewards import builtin_reward_function

    if (builtin := builtin_reward_function(data_source)) is not None:
        return float(builtin(data_source, solution_str, ground_truth, extra_info))
    if ground_truth is None:
        return 0.0
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", solution_str)
    answer = (boxed[-1] if boxed else solution_str).strip()
    expected = str(ground_truth).strip()
    a, b = _number(answer), _number(expected)
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-6 * max(1.0, abs(b)))
    return float(answer == expected)


def _resolve_score(compute_score: ComputeScore | str | None) -> ComputeScore:
    if compute_score is None:
        return default_score
    if isinstance(compute_score, str):
        from asyncrl.generation.envs.loading import PluginError, load_object

        function = load_object(compute_score, what="compute_score")
        if not callable(function):
            raise PluginError(f"compute_score {compute_score!r} is not callable")
        return function
    return compute_score


class ToolEnvironment(Environment):
    def __init__(
        self,
        tools: Sequence[str | Tool] = ("calculator", "python"),
        *,
        compute_score: ComputeScore | str | None = None,
        parser: str | ToolCallParser = "hermes",
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        tools_prompt: str = TOOLS_PROMPT,
        max_turns: int | None = None,
        max_calls_per_turn: int = 4,
        max_tool_output_chars: int = 4000,
        python_timeout_s: float = 5.0,
        python_memory_mb: int = 512,
        defer_score: bool = False,
    ):
        """``tools_prompt``: the tool listing after the system prompt, ``{schemas}`` in
        it replaced by the schemas (no other braces are special); ``""`` leaves it
        out, for a model shown the tools some other way (a small model may follow
        worked examples in the prompt better than a long listing).
        ``max_turns``, when given, lets the environment skip running tools on the
        last turn the driver allows (their output could not be shown).
        ``defer_score``: answer the final turn with a :class:`ScoreRequest` when the
        reward function has a name (see the module doc)."""
        self.tools = build_tools(
            tools, python_timeout_s=python_timeout_s, python_memory_mb=python_memory_mb
        )
        self.compute_score = _resolve_score(compute_score)
        self.score_function: str | None = None
        """``compute_score``'s ``module:function`` name; None for a Python callable
        (or a dotted ``module:Class.method``, which reward workers cannot load)."""
        if compute_score is None:
            self.score_function = DEFAULT_SCORE
        elif isinstance(compute_score, str) and "." not in compute_score.rpartition(":")[2]:
            self.score_function = compute_score
        self.defer_score = defer_score
        self.parser = make_parser(parser)
        self.system_prompt = system_prompt
        self.tools_prompt = tools_prompt
        self.max_turns = max_turns
        self.max_calls_per_turn = max_calls_per_turn
        self.max_tool_output_chars = max_tool_output_chars
        self._row: Mapping[str, Any] = {}
        self._turns = 0

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self.tools.values()]

    def system_message(self, base: str | None = None) -> str:
        schemas = "\n".join(json.dumps(schema) for schema in self.tool_schemas())
        head = self.system_prompt if base is None else base
        if not self.tools or not self.tools_prompt:
            return head
        return f"{head}\n\n{self.tools_prompt.replace('{schemas}', schemas)}"

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        self._row = row
        self._turns = 0
        messages = prompt_messages(row)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = self.system_message(messages[0]["content"])
            return messages
        return [{"role": "system", "content": self.system_message()}, *messages]

    def score_request(self, solution_str: str) -> ScoreRequest:
        """The final answer, for the named reward function to score elsewhere."""
        if self.score_function is None:
            raise ValueError("compute_score is a Python callable: it has no name to send")
        row = self._row
        return ScoreRequest(
            self.score_function,
            solution_str,
            row.get("data_source", ""),
            ground_truth(row),
            row.get("extra_info"),
        )

    def score(self, solution_str: str) -> float:
        row = self._row
        score = self.compute_score(
            row.get("data_source", ""), solution_str, ground_truth(row), row.get("extra_info")
        )
        if isinstance(score, Mapping):  # verl lets a scorer return {"score": ..., ...}
            score = score["score"]
        return float(score)

    def run_call(self, call: ToolCall | ToolCallError) -> tuple[str, str, bool]:
        """``(tool name, output, ok)`` for one parsed call; never raises."""
        if isinstance(call, ToolCallError):
            return "", f"Error: {call.message}", False
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return call.name, f"Error: unknown tool {call.name!r}; available: {known}", False
        try:
            output = tool.call(call.arguments)
        except ToolError as exc:
            return call.name, f"Error: {exc}", False
        except Exception as exc:  # a broken tool must not end the rollout
            return call.name, f"Error: {call.name} failed: {type(exc).__name__}: {exc}", False
        return call.name, output, True

    def step(self, response: str) -> StepResult:
        self._turns += 1
        parsed = self.parser.parse(response)
        if not parsed.calls:
            if self.defer_score and self.score_function is not None:
                return StepResult(done=True, score_request=self.score_request(response))
            return StepResult(done=True, reward=self.score(response))
        if self.max_turns is not None and self._turns >= self.max_turns:
            # The driver stops here; running the tools would be wasted work.
            return StepResult(tool_calls=len(parsed.calls), tool_errors=len(parsed.errors))
        messages: list[Message] = []
        errors = 0
        for index, call in enumerate(parsed.calls):
            if index >= self.max_calls_per_turn:
                name = getattr(call, "name", "")
                output = f"Error: at most {self.max_calls_per_turn} tool calls per turn"
                ok = False
            else:
                name, output, ok = self.run_call(call)
            errors += not ok
            if len(output) > self.max_tool_output_chars:
                output = output[: self.max_tool_output_chars] + "\n[output truncated]"
            messages.append({"role": "tool", "name": name, "content": output})
        return StepResult(messages=messages, tool_calls=len(parsed.calls), tool_errors=errors)
