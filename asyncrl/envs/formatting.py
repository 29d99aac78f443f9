"""Text around the model's turns, and the text <-> token codec.

A turn formatter renders chat messages to text in two places only:

- ``render_prompt(messages)``: the whole prompt, ending with the cue that
  opens the model's first turn;
- ``render_reply(messages, turn_text)``: what the environment says after a
  model turn, starting by closing that turn if the model's tokens did not
  (a backend that cut a stop string) and ending with the cue for the next one.

The rollout driver tokenizes each piece on its own and appends it; it never
renders or tokenizes the conversation as a whole. :class:`ChatMLFormatter` is
the Qwen/Hermes chat format; :class:`PlainTextFormatter` is for tests and
tokenizers without chat tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from asyncrl.envs.base import Message


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


FORMATTERS: dict[str, Callable[[], TurnFormatter]] = {
    "chatml": ChatMLFormatter,
    "plain": PlainTextFormatter,
}
