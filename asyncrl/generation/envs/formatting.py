"""Text around the model's turns, and the text <-> token codec.

A turn formatter renders chat messages to text in two places only:

- ``render_prompt(messages)``: the whole prompt, ending with the cue that
  opens the model's first turn;
- ``render_reply(messages, turn_text)``: what the environment says after a
  model turn, starting by closing that turn if the model's tokens did not
  (a backend that cut a stop string) and ending with the cue for the next one.

The rollout driver tokenizes each piece on its own and appends it; it never
renders or tokenizes the conversation as a whole. :class:`TemplateFormatter`
renders with the model's own chat template (``tokenizer.chat_template``);
:class:`ChatMLFormatter` is the Qwen/Hermes chat format written out by hand;
:class:`PlainTextFormatter` is for tests and tokenizers without chat tokens.
:func:`build_formatter` makes one from the ``environment.formatter`` setting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from asyncrl.generation.envs.base import Message


@dataclass(frozen=True)
class Codec:
    encode: Callable[[str], list[int]]
    """Text to token ids, adding no special tokens of its own (no BOS)."""
    decode: Callable[[Sequence[int]], str]
    """Token ids to text, special tokens kept (so turn markers can be seen)."""

    @classmethod
    def from_hf(cls, tokenizer) -> Codec:
        """From a Hugging Face tokenizer."""
        return cls(
            encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
            decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=False),
        )


@runtime_checkable
class TurnFormatter(Protocol):
    end_of_turn: str
    """The text that ends a model turn; the driver asks the model to stop there."""

    def render_prompt(self, messages: list[Message]) -> str: ...

    def render_reply(self, messages: list[Message], turn_text: str) -> str: ...


@dataclass(frozen=True)
class ChatMLFormatter:
    """``<|im_start|>role\\ncontent<|im_end|>\\n``; tool results as Qwen renders them.

    Consecutive ``tool`` messages share one ``user`` turn, each in
    ``<tool_response>`` tags, as in the Qwen2.5/Qwen3 chat templates.
    """

    end_of_turn: str = "<|im_end|>"
    start: str = "<|im_start|>"
    assistant_cue: str = "<|im_start|>assistant\n"

    def _render(self, messages: list[Message]) -> str:
        parts: list[str] = []
        index = 0
        while index < len(messages):
            message = messages[index]
            if message["role"] == "tool":
                responses = []
                while index < len(messages) and messages[index]["role"] == "tool":
                    content = messages[index]["content"]
                    responses.append(f"<tool_response>\n{content}\n</tool_response>")
                    index += 1
                body = "\n".join(responses)
                parts.append(f"{self.start}user\n{body}{self.end_of_turn}\n")
                continue
            parts.append(f"{self.start}{message['role']}\n{message['content']}{self.end_of_turn}\n")
            index += 1
        return "".join(parts)

    def render_prompt(self, messages: list[Message]) -> str:
        return self._render(messages) + self.assistant_cue

    def render_reply(self, messages: list[Message], turn_text: str) -> str:
        close = "" if turn_text.endswith(self.end_of_turn) else self.end_of_turn
        return close + "\n" + self._render(messages) + self.assistant_cue


@dataclass(frozen=True)
class PlainTextFormatter:
    """``role: content`` lines; the model's turn ends with ``end_of_turn``."""

    end_of_turn: str = "<end>"
    assistant_cue: str = "assistant: "

    def _render(self, messages: list[Message]) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    def render_prompt(self, messages: list[Message]) -> str:
        return self._render(messages) + self.assistant_cue

    def render_reply(self, messages: list[Message], turn_text: str) -> str:
        close = "" if turn_text.endswith(self.end_of_turn) else self.end_of_turn
        return close + "\n" + self._render(messages) + self.assistant_cue


class TemplateFormatError(ValueError):
    """The model's chat template cannot render an episode turn by turn."""


class _Refused(Exception):
    """The chat template raised while rendering (e.g. a role it does not take)."""


def _probe(role: str, tag: str) -> Message:
    """A message whose content is a marker no template or model would write."""
    return {"role": role, "content": f"[asyncrl probe: {tag}]"}


def _common_prefix(a: str, b: str) -> str:
    at = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return a[:at]


def _first_difference(expected: str, got: str) -> str:
    """Where two renderings part, for an error message."""
    at = len(_common_prefix(expected, got))
    start = max(0, at - 30)
    return f"at character {at}, {expected[start : at + 40]!r} became {got[start : at + 40]!r}"


class TemplateFormatter:
    """Turns rendered by the model's own chat template (``tokenizer.chat_template``).

    The prompt is the template's rendering of the messages with the generation
    prompt. A reply is a *delta*: the template renders a probe conversation that
    ends with an assistant turn (a sentinel as its content), then the same with the
    environment's messages after it and the generation prompt; the reply is what
    the second rendering has after the sentinel. It starts by closing the model's
    turn (dropped when the model's tokens already end with ``end_of_turn``) and
    ends with the cue that opens the next assistant turn, so nothing the model
    generated is ever rendered again.

    This is only right for templates that render each turn on its own, leaving
    earlier text as it was when later messages are added: the constructor
    checks that with probe conversations (a user reply and a tool reply, two
    turns each) and raises :class:`TemplateFormatError` naming what changed (e.g.
    a template that moves the system prompt into the last user message). A
    template that refuses ``tool`` messages (Gemma's) is accepted, but a reply
    with one raises. ``end_of_turn`` is what the template puts right after an
    assistant message's content, up to the line end (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``).
    """

    def __init__(self, tokenizer: Any, model: str | None = None):
        """``model``: named in errors (default: the tokenizer's ``name_or_path``)."""
        self.tokenizer = tokenizer
        self.model = model or getattr(tokenizer, "name_or_path", "") or "this tokenizer"
        if not getattr(tokenizer, "chat_template", None):
            raise self._error("its tokenizer has no chat template")
        self._history = self._probe_history()
        self.end_of_turn = self._find_end_of_turn()
        self._refused: dict[str, str] = {}
        """Reply roles the template raised for, and what it said."""
        self._check_replies("user", [[_probe("user", "reply 1")], [_probe("user", "reply 2")]])
        tools = [[_probe("tool", "result 1a"), _probe("tool", "result 1b")]]
        self._check_replies("tool", [*tools, [_probe("tool", "result 2")]], optional=True)

    def _error(self, reason: str) -> TemplateFormatError:
        return TemplateFormatError(
            f"environment.formatter: template cannot render episodes with the chat template "
            f"of {self.model}: {reason}. Use environment.formatter: chatml (Qwen/Hermes "
            f"ChatML) or plain instead, or give the tokenizer a chat template that renders "
            f"each turn on its own"
        )

    def _render(self, messages: list[Message], generation: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation
            )
        except Exception as error:  # jinja2's TemplateError, raise_exception(), a bad key
            raise _Refused(f"{type(error).__name__}: {error}") from error
        if not isinstance(text, str):
            raise _Refused(f"apply_chat_template(tokenize=False) gave {type(text).__name__}")
        return text

    def _probe_history(self) -> list[Message]:
        """The conversation the probes continue: a system and a user message, or only
        the user message if the template refuses a system message."""
        user = _probe("user", "question")
        for history in ([_probe("system", "instructions"), user], [user]):
            try:
                self._render(history, True)
                return history
            except _Refused as error:
                refusal = error
        raise self._error(f"it cannot render a one-message conversation ({refusal})")

    def _find_end_of_turn(self) -> str:
        """What follows an assistant message's content, up to the line end; the same
        whether the message is last or another follows (so not the next turn's start)."""
        sentinel = _probe("assistant", "turn")
        texts: list[str] = []
        following: list[str] = []
        for after in ([], [_probe("user", "next")]):
            try:
                text = self._render([*self._history, sentinel, *after], False)
            except _Refused as error:
                raise self._error(f"it cannot render an assistant turn ({error})") from None
            at = text.rfind(sentinel["content"])
            if at < 0 and after:
                shown = texts[0][: texts[0].rfind(sentinel["content"])] + sentinel["content"]
                raise self._error(
                    f"the prefix changed: an assistant turn is rendered differently once "
                    f"another message follows it ({_first_difference(shown, text)})"
                )
            if at < 0:
                raise self._error("an assistant message's content is not in its rendering")
            texts.append(text)
            following.append(text[at + len(sentinel["content"]) :])
        closing = _common_prefix(*following)
        marker = closing.split("\n", 1)[0].rstrip()
        if not marker or marker != marker.lstrip():
            raise self._error(
                f"no end-of-turn marker right after an assistant message's content "
                f"(it is followed by {following[0][:40]!r})"
            )
        return marker

    def _check_replies(
        self, role: str, replies: list[list[Message]], *, optional: bool = False
    ) -> None:
        """Two turns, each answered by ``replies``: each rendering must start with the
        one before it plus the model's turn, and the reply must close the turn first."""
        conversation = list(self._history)
        rendered = self._render(conversation, True)
        for number, reply in enumerate(replies, start=1):
            conversation.append(_probe("assistant", f"turn {number}"))
            expected = rendered + conversation[-1]["content"]
            try:
                rendered = self._render([*conversation, *reply], True)
            except _Refused as error:
                if not optional:
                    raise self._error(f"it cannot render a {role!r} reply ({error})") from None
                self._refused[role] = str(error)
                return
            if not rendered.startswith(expected):
                raise self._error(
                    f"the prefix changed: adding a {role!r} reply after assistant turn "
                    f"{number} changes the text before it ({_first_difference(expected, rendered)}"
                    f"), so a reply cannot be appended to the tokens already generated"
                )
            if not rendered[len(expected) :].startswith(self.end_of_turn):
                raise self._error(
                    f"a {role!r} reply does not start by closing the assistant turn with "
                    f"{self.end_of_turn!r}"
                )
            conversation += reply

    def render_prompt(self, messages: list[Message]) -> str:
        try:
            return self._render(messages, True)
        except _Refused as error:
            raise self._error(f"it cannot render the prompt's messages ({error})") from None

    def render_reply(self, messages: list[Message], turn_text: str) -> str:
        for message in messages:
            if message.get("role") in self._refused:
                raise self._error(
                    f"the environment replied with a {message['role']!r} message, which the "
                    f"template refuses ({self._refused[message['role']]}); an environment "
                    f"for this model must reply with 'user' messages"
                )
        turn = _probe("assistant", "turn")
        try:
            before = self._render(self._history, True) + turn["content"]
            after = self._render([*self._history, turn, *messages], True)
        except _Refused as error:
            raise self._error(f"it cannot render the environment's reply ({error})") from None
        if not after.startswith(before):
            raise self._error(
                f"the prefix changed: the environment's reply changes the text before it "
                f"({_first_difference(before, after)})"
            )
        reply = after[len(before) :]
        if turn_text.endswith(self.end_of_turn):  # the model closed its own turn
            reply = reply[len(self.end_of_turn) :]
        return reply


FORMATTERS: dict[str, Callable[[], TurnFormatter]] = {
    "chatml": ChatMLFormatter,
    "plain": PlainTextFormatter,
}
"""The formatters that need no tokenizer; :func:`build_formatter` knows them all."""


def build_formatter(name: str, tokenizer: Any = None) -> TurnFormatter:
    """The formatter ``environment.formatter`` names: ``template`` renders with
    ``tokenizer``'s chat template; ``auto`` is ``template`` when the tokenizer has one
    and ``chatml`` when it has none."""
    if name == "auto":
        name = "template" if getattr(tokenizer, "chat_template", None) else "chatml"
    if name == "template":
        if tokenizer is None:
            raise ValueError("environment.formatter: template needs the model's tokenizer")
        return TemplateFormatter(tokenizer)
    if name not in FORMATTERS:
        known = ", ".join(["auto", "template", *FORMATTERS])
        raise ValueError(f"environment.formatter: unknown formatter {name!r} (known: {known})")
    return FORMATTERS[name]()
