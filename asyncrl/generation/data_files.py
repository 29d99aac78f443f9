"""Prompt files read within bounds: the rows of a JSONL or parquet file as plain objects.

A prompt file is the user's, and may be anything: a file without newlines, a
parquet file whose one 300 MB cell decompresses from 15 MB (it drove
``asyncrl validate`` to 13.6 GB before these caps), a number of 5,000 digits. So
each size is capped, and checked before the thing it bounds is read whole:

====================  =====================  ==========================================
what                  cap                    checked
====================  =====================  ==========================================
a row (its cells)     :data:`MAX_ROW_BYTES`  JSONL: the line, read at most this far;
                                             parquet: the row's cells once its batch is
                                             decoded, before they become Python objects
a parquet row group   :data:`MAX_ROW_GROUP_  the layout's columns, uncompressed, from the
                      BYTES`                 file's metadata, before the group is read
a file                :data:`MAX_FILE_BYTES` its size (JSONL) or its columns' uncompressed
                                             size (parquet), before any row is read
rows of a file        :data:`MAX_ROWS`       parquet: from the metadata; JSONL: as read
====================  =====================  ==========================================

Only the layout's columns (:data:`LAYOUT_COLUMNS`) of a parquet file are read, a
batch of rows at a time. Every problem is a :class:`DataError` of one line naming
the file and, for a row, its number (JSONL: the line; parquet: the row; from 1).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAX_ROW_BYTES = 1 << 20
"""The largest row (1 MiB): a JSONL line, or a parquet row's cells together. A longer one is
an error naming its row, read no further than this."""
MAX_LINE_BYTES = MAX_ROW_BYTES
MAX_ROW_GROUP_BYTES = 64 << 20
"""The largest parquet row group (64 MiB of the layout's columns, uncompressed): a group is
decoded a batch at a time, but one cell is decoded whole, so this bounds the memory a file
can take however its bytes are spread."""
MAX_FILE_BYTES = 4 << 30
"""The largest prompt file (4 GiB; parquet: its layout's columns uncompressed)."""
MAX_ROWS = 1 << 24
"""The most rows (16,777,216; blank JSONL lines count) one prompt file may have."""
LAYOUT_COLUMNS = ("prompt", "data_source", "reward_model", "extra_info")
"""The columns a prompt row is made of; a parquet file's other columns are not read."""
_BATCH_ROWS = 64


class DataError(ValueError):
    """A file that cannot be read, or a row without the fields the layout requires."""


def one_line(error: BaseException, limit: int = 300, typed: bool = True) -> str:
    """``Type: message`` (``typed``) or the message, on one line, cut at ``limit``
    characters: a multi-line message from a template or a library stays one line."""
    text = f"{type(error).__name__}: {error}" if typed else str(error)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def raw_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(row number, the row's object or a DataError)`` for each row of ``path``; a file
    that cannot be read at all (missing, unknown type, over a cap) raises a DataError."""
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif suffix == ".parquet":
        yield from _parquet_rows(path)
    else:
        raise DataError(f"{path}: unknown data file type '{suffix}'; use .parquet or .jsonl")


def _size(count: float) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if count >= 1 << shift:
            return f"{count / (1 << shift):.1f} {unit}"
    return f"{count:.0f} bytes"


def _limit(count: int) -> str:
    """A cap as the docs write it: ``1 MiB``, ``256 MiB``, ``4 GiB``."""
    return _size(count).replace(".0 ", " ")


def _too_big_file(path: Path, size: int, what: str) -> None:
    if size > MAX_FILE_BYTES:
        raise DataError(
            f"{path}: {what} {_size(size)}; a prompt file is at most {_limit(MAX_FILE_BYTES)} "
            "(split it into several files)"
        )


def _too_many_rows(path: Path, rows: int) -> None:
    if rows > MAX_ROWS:
        raise DataError(
            f"{path}: more than {MAX_ROWS:,} rows; a prompt file has at most that many "
            "(split it into several files)"
        )


# --------------------------------------------------------------------------
# JSONL


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Line numbers with their JSON values (blank lines skipped, still counted)."""
    try:
        file = path.open("rb")
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror}") from None
    with file:
        _too_big_file(path, Path(path).stat().st_size, "is")
        number = 0
        while line := file.readline(MAX_LINE_BYTES + 1):
            number += 1
            _too_many_rows(path, number)
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                _skip_line(file)
                problem = (
                    f"line longer than {_limit(MAX_LINE_BYTES)}; a prompt row is far shorter "
                    "(is it JSONL?)"
                )
                yield number, DataError(f"{path}:{number}: {problem}")
                continue
            if number == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte order mark
            if line.strip():
                yield number, _json_value(line, f"{path}:{number}")


def _skip_line(file) -> None:
    """Read past the rest of an over-long line, a bounded chunk at a time."""
    while (chunk := file.readline(MAX_LINE_BYTES)) and not chunk.endswith(b"\n"):
        pass


def _json_value(line: bytes, where: str) -> Any:
    """One JSONL line's value, or a DataError naming ``where`` and the column."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as error:
        return DataError(
            f"{where}: not UTF-8 text (byte 0x{line[error.start]:02x} at byte "
            f"{error.start + 1} of the line); save the file as UTF-8"
        )
    try:
        return json.loads(text.rstrip("\r\n"))
    except json.JSONDecodeError as error:
        return DataError(f"{where}: not valid JSON at column {error.colno}: {error.msg}")
    except RecursionError:
        return DataError(f"{where}: not valid JSON: nested too deeply")
    except ValueError:  # int() refusing a number of more digits than Python reads
        limit = sys.get_int_max_str_digits()
        return DataError(
            f"{where}: a number of more than {limit} digits, which Python does not read; "
            "a prompt row needs none"
        )


# --------------------------------------------------------------------------
# parquet


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Row numbers with their rows as dicts of the layout's columns, a batch at a time,
    every cap checked from the file's metadata before the data it bounds is read."""
    try:
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover - pyarrow is a dependency
        raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as error:
        raise DataError(f"{path}: cannot read parquet: {one_line(error)}") from None
    with file:
        metadata = file.metadata
        columns = [name for name in file.schema_arrow.names if name in LAYOUT_COLUMNS]
        groups = [
            _group_bytes(metadata.row_group(i), columns) for i in range(metadata.num_row_groups)
        ]
        _too_many_rows(path, metadata.num_rows)
        _too_big_file(path, sum(size for size, _ in groups), "holds, uncompressed,")
        first = 1
        for index, (size, biggest) in enumerate(groups):
            rows = metadata.row_group(index).num_rows
            if size > MAX_ROW_GROUP_BYTES:
                raise DataError(_group_too_big(path, index, first, rows, size, biggest))
            try:
                batches = file.iter_batches(
                    batch_size=_BATCH_ROWS, row_groups=[index], columns=columns
                )
                number = first
                for batch in batches:
                    yield from _batch_rows(batch, path, number)
                    number += batch.num_rows
            except DataError:
                raise
            except Exception as error:
                raise DataError(
                    f"{path}: cannot read parquet row group {index} (rows {first} to "
                    f"{first + rows - 1}): {one_line(error)}"
                ) from None
            first += rows


def _group_bytes(group, columns: list[str]) -> tuple[int, tuple[str, int]]:
    """A row group's uncompressed bytes in ``columns``, and its biggest column chunk's name
    and size, as the metadata states them."""
    sizes: dict[str, int] = {}
    for chunk in range(group.num_columns):
        column = group.column(chunk)
        name = column.path_in_schema.split(".")[0]
        if name in columns:
            sizes[name] = sizes.get(name, 0) + max(column.total_uncompressed_size, 0)
    biggest = max(sizes.items(), key=lambda item: item[1], default=("", 0))
    return sum(sizes.values()), biggest


def _group_too_big(path: Path, index: int, first: int, rows: int, size: int, biggest) -> str:
    column, column_size = biggest
    return (
        f"{path}: row group {index} (rows {first} to {first + rows - 1}) holds "
        f"{_size(size)} uncompressed, {_size(column_size)} of it in column '{column}'; "
        f"a row group may hold at most {_limit(MAX_ROW_GROUP_BYTES)} (one cell is decoded "
        f"whole; a row is at most {_limit(MAX_ROW_BYTES)}): write the file with smaller row "
        "groups, e.g. pyarrow.parquet.write_table(table, path, row_group_size=1000)"
    )


def _batch_rows(batch, path: Path, first: int) -> Iterator[tuple[int, Any]]:
    """The rows of one decoded batch: a row over :data:`MAX_ROW_BYTES` is refused before it
    becomes Python objects, and one that cannot become them is refused alone."""
    whole = batch.nbytes <= MAX_ROW_BYTES
    rows = None
    if whole:
        try:
            rows = batch.to_pylist()
        except Exception:
            rows = None
    for offset in range(batch.num_rows):
        number = first + offset
        if rows is not None:
            yield number, rows[offset]
            continue
        one = batch.slice(offset, 1)
        if one.nbytes > MAX_ROW_BYTES:
            yield (
                number,
                DataError(
                    f"{path}:{number}: a row of {_size(one.nbytes)}; a prompt row is at most "
                    f"{_limit(MAX_ROW_BYTES)}"
                ),
            )
            continue
        try:
            yield number, one.to_pylist()[0]
        except Exception as error:
            yield number, DataError(f"{path}:{number}: cannot read this row: {one_line(error)}")
