"""Prompts from files in the verl layout, with random access by an integer index.

Each row (a JSONL line, or a parquet row) holds::

    prompt         [{"role": "user", "content": "..."}, ...]   chat messages
                   or "Question: ... Answer:"                 plain text
    data_source    "openai/gsm8k"            picks the reward function
    reward_model   {"ground_truth": "72", ...}
    extra_info     {...}                     optional; passed to the reward function

Chat messages are rendered with the tokenizer's chat template (with the generation
prompt); plain text is used as it is, tokenized with the tokenizer's own rule for
special tokens (a BOS first where the tokenizer adds one), which is how a base model
without a chat template is prompted. Rows whose rendering is longer than
``max_prompt_tokens`` are dropped and counted (``filtered_too_long``).
``dataset[i]`` is a pure function of ``i``: with ``n`` rows kept, index ``i`` is
position ``i % n`` of epoch ``i // n``, whose order is a permutation seeded by
``(seed, epoch)`` (or the file order, without ``shuffle``). So the buffer's cursor,
an int, is all the state a resumed run needs.

Every problem with a file is a :class:`DataError` of one line naming the file
and, for a row, its number (JSONL: the line; parquet: the row, both from 1):
not UTF-8, not JSON, a row over its size cap (:mod:`asyncrl.generation.data_files` reads the
files within documented caps), a missing field, a value that cannot be sent on
(an integer past 64 bits in ``extra_info``), a chat template that refuses the
row. :func:`scan_rows` reports a file's row problems one by one, for
:mod:`asyncrl.run.preflight` to list them all.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.generation.data_files import MAX_LINE_BYTES as MAX_LINE_BYTES
from asyncrl.generation.data_files import MAX_ROW_BYTES as MAX_ROW_BYTES
from asyncrl.generation.data_files import DataError as DataError
from asyncrl.generation.data_files import one_line as one_line
from asyncrl.generation.data_files import raw_rows

log = logging.getLogger("asyncrl.data")


@dataclass(frozen=True)
class PromptRow:
    """One prompt, ready to generate from."""

    index: int
    """The dataset index it was fetched by."""
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    source: str = ""
    """``file:row`` it came from (row numbers from 1)."""
    messages: list[dict[str, str]] = field(default_factory=list)
    """The prompt as chat messages, before rendering; empty for a plain-text prompt."""


@dataclass(frozen=True)
class Row:
    """One row of a prompt file, checked against the layout, not yet rendered."""

    messages: list[dict[str, str]]
    data_source: str
    ground_truth: str
    extra_info: dict
    source: str
    text: str | None = None
    """The prompt as plain text (``messages`` then empty); None: chat messages."""

    @property
    def form(self) -> str:
        return "chat" if self.text is None else "text"


class PromptDataset:
    """The rows of ``files`` (``.parquet``, ``.jsonl``) that fit in ``max_prompt_tokens``.

    ``len(dataset)`` is the number of rows kept (one epoch); any index ``>= 0``
    is valid. ``filtered_too_long`` counts the rows dropped; ``data_sources``
    counts the kept rows by ``data_source``.
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer,
        max_prompt_tokens: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if isinstance(files, str | Path):
            files = [files]
        if not files:
            raise DataError("no data files given")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.filtered_too_long = 0
        self.rows: list[Row] = []
        for path in map(Path, files):
            for row in read_rows(path):
                if len(render_row(tokenizer, row)) > max_prompt_tokens:
                    self.filtered_too_long += 1
                else:
                    self.rows.append(row)
        total = len(self.rows) + self.filtered_too_long
        if self.filtered_too_long:
            log.warning(
                "%d of %d prompts are longer than max_prompt_tokens=%d and are skipped",
                self.filtered_too_long,
                total,
                max_prompt_tokens,
            )
        if not self.rows:
            raise DataError(
                f"no prompts left in {', '.join(map(str, files))}: {total} rows, "
                f"{self.filtered_too_long} longer than max_prompt_tokens={max_prompt_tokens}"
            )
        self.data_sources = Counter(row.data_source for row in self.rows)
        self._orders: dict[int, np.ndarray] = {}
        log.info("%d prompts from %d file(s)", len(self.rows), len(files))

    def __len__(self) -> int:
        return len(self.rows)

    def row_index(self, index: int) -> int:
        """Which kept row dataset index ``index`` is (its epoch's permutation applied)."""
        if index < 0:
            raise IndexError(f"dataset index must be >= 0, got {index}")
        epoch, position = divmod(index, len(self.rows))
        if not self.shuffle:
            return position
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) >= 4:  # requeued groups may ask for a recent epoch again
                self._orders.pop(next(iter(self._orders)))
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
            self._orders[epoch] = order
        return int(order[position])

    def __getitem__(self, index: int) -> PromptRow:
        row = self.rows[self.row_index(index)]
        return PromptRow(
            index,
            render_row(self.tokenizer, row),
            row.data_source,
            row.ground_truth,
            row.extra_info,
            row.source,
            row.messages,
        )


def render_row(tokenizer, row: Row) -> list[int]:
    """The prompt token ids of ``row``: its text as it is, or its messages in the chat
    template (a :class:`DataError` naming the row when the tokenizer has none)."""
    if row.text is not None:
        return encode_text(tokenizer, row.text)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{row.source}: a chat-message prompt, and the tokenizer has no chat template "
            "(a base model?): give the prompt as a plain string instead, or use a model "
            "whose tokenizer has one"
        )
    return render_prompt(tokenizer, row.messages, row.source)


def encode_text(tokenizer, text: str) -> list[int]:
    """``text`` as token ids, with the special tokens the tokenizer adds itself (a BOS
    first for Gemma's and Llama's; nothing for a ChatML tokenizer's)."""
    return [int(token) for token in tokenizer(text, add_special_tokens=True)["input_ids"]]


def render_prompt(tokenizer, messages: list[dict[str, str]], where: str) -> list[int]:
    """Token ids of ``messages`` in ``tokenizer``'s chat template, with the generation
    prompt. A template that fails (its own ``raise_exception``, say, for roles out of
    order) is a :class:`DataError` naming ``where`` (``file:row``) and its message."""
    try:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as error:
        raise DataError(
            f"{where}: the chat template cannot render this prompt: {one_line(error)}"
        ) from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(token) for token in ids]


def read_rows(path: str | Path) -> Iterator[Row]:
    """The rows of one file, checked; the first problem raises :class:`DataError`."""
    for row in scan_rows(path):
        if isinstance(row, DataError):
            raise row
        yield row


def scan_rows(path: str | Path) -> Iterator[Row | DataError]:
    """The rows of one file, each checked: a bad row comes as its :class:`DataError`
    and the scan goes on; a file that cannot be read at all (missing, unknown type,
    unreadable parquet, no rows) raises one."""
    path = Path(path)
    empty = True
    for number, raw in raw_rows(path):
        empty = False
        where = f"{path}:{number}"
        if isinstance(raw, DataError):
            yield raw
            continue
        try:
            yield _parse_row(raw, where)
        except DataError as error:
            yield error
    if empty:
        raise DataError(f"{path}: no rows (the file is empty or blank)")


def _parse_row(raw: Any, where: str) -> Row:
    """Check one row against the layout; errors name ``file:row`` and the field."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object, got {type(raw).__name__}")
    messages = raw.get("prompt")
    if messages is None:
        raise DataError(f"{where}: missing field 'prompt' (chat messages or a string)")
    text = None
    if isinstance(messages, str):
        if not messages.strip():
            raise DataError(f"{where}: 'prompt' is an empty string")
        text, messages = messages, [{"role": "user", "content": messages}]
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: 'prompt' must be a string or a non-empty list of {{role, content}} messages"
        )
    for number, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DataError(f"{where}: prompt[{number}] must have string 'role' and 'content'")
    data_source = raw.get("data_source")
    if not isinstance(data_source, str):
        raise DataError(f"{where}: missing field 'data_source' (a string)")
    reward_model = raw.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise DataError(f"{where}: missing field 'reward_model.ground_truth'")
    truth = reward_model["ground_truth"]
    if not isinstance(truth, str):
        truth = _as_text(truth, where)
    extra_info = raw.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: 'extra_info' must be an object, got {type(extra_info).__name__}")
    _check_sendable(extra_info, where)
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    return Row(
        [] if text is not None else chat,
        data_source,
        truth,
        extra_info,
        where,
        text,
    )


def _as_text(truth: Any, where: str) -> str:
    """A ground truth that is not a string, written as JSON (a number, a list, ...)."""
    try:
        return json.dumps(truth.tolist() if isinstance(truth, np.ndarray) else truth)
    except (TypeError, ValueError) as error:
        raise DataError(
            f"{where}: 'reward_model.ground_truth' cannot be written as text: {one_line(error)}"
        ) from None


def _check_sendable(extra_info: dict, where: str) -> None:
    """``extra_info`` travels to the generators and the reward workers as msgpack: refuse
    here, naming the row, what cannot (an integer past 64 bits, an unknown type)."""
    from asyncrl.generation.rewards.channel import encode_jobs

    try:
        encode_jobs([extra_info])
    except (TypeError, ValueError, OverflowError) as error:
        raise DataError(
            f"{where}: 'extra_info' holds a value that cannot be sent to the reward function: "
            f"{one_line(error, typed=False)}"
        ) from None
