"""Prompts from files in the verl layout, with random access by an integer index.

Each row (a JSONL line, or a parquet row) holds::

    prompt         [{"role": "user", "content": "..."}, ...]   chat messages
    data_source    "openai/gsm8k"            picks the reward function
    reward_model   {"ground_truth": "72", ...}
    extra_info     {...}                     optional; passed to the reward function

The prompt is rendered with the tokenizer's chat template (with the generation
prompt); rows whose rendering is longer than ``max_prompt_tokens`` are dropped
and counted (``filtered_too_long``). ``dataset[i]`` is a pure function of
``i``: with ``n`` rows kept, index ``i`` is position ``i % n`` of epoch
``i // n``, whose order is a permutation seeded by ``(seed, epoch)`` (or the
file order, without ``shuffle``). So the buffer's cursor, an int, is all the
state a resumed run needs.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("asyncrl.data")


class DataError(ValueError):
    """A file that cannot be read, or a row without the fields the layout requires."""


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
    """The prompt as chat messages, before rendering."""


@dataclass(frozen=True)
class _Row:
    messages: list[dict[str, str]]
    data_source: str
    ground_truth: str
    extra_info: dict
    source: str


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
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "the tokenizer has no chat template, so chat-message prompts cannot be rendered; "
                "use a model whose tokenizer has one, or set tokenizer.chat_template"
            )
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.filtered_too_long = 0
        self.rows: list[_Row] = []
        for path in map(Path, files):
            for number, raw in enumerate(_read_rows(path), start=1):
                row = _parse_row(raw, f"{path}:{number}")
                if len(self.render(row.messages)) > max_prompt_tokens:
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

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` in the chat template, ending with the assistant's turn."""
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(token) for token in ids]

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
            self.render(row.messages),
            row.data_source,
            row.ground_truth,
            row.extra_info,
            row.source,
            row.messages,
        )


def _read_rows(path: Path):
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{number}: not valid JSON: {error}") from None
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:  # pragma: no cover - pyarrow is a dependency
            raise DataError(
                f"{path}: reading parquet needs pyarrow (pip install pyarrow)"
            ) from None
        try:
            table = pq.read_table(path)
        except Exception as error:
            raise DataError(f"{path}: cannot read parquet: {error}") from None
        yield from table.to_pylist()
    else:
        raise DataError(f"{path}: unknown data file type '{suffix}'; use .parquet or .jsonl")


def _parse_row(raw: Any, where: str) -> _Row:
    """Check one row against the layout; errors name ``file:row`` and the field."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object, got {type(raw).__name__}")
    messages = raw.get("prompt")
    if messages is None:
        raise DataError(f"{where}: missing field 'prompt' (a list of chat messages)")
    if isinstance(messages, np.ndarray):
        messages = messages.tolist()
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'prompt' must be a non-empty list of {{role, content}} messages")
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
        truth = json.dumps(truth.tolist() if isinstance(truth, np.ndarray) else truth)
    extra_info = raw.get("extra_info") or {}
    if not isinstance(extra_info, dict):
        raise DataError(f"{where}: 'extra_info' must be an object, got {type(extra_info).__name__}")
    return _Row(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        data_source,
        truth,
        extra_info,
        where,
    )
