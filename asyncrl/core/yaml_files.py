"""Reading YAML a person wrote, within bounds: the config file and overrides.

PyYAML's safe loader builds no objects, but it will expand an alias bomb for
minutes, recurse until Python gives up, read any size of file and keep the last
of two equal keys. :func:`read_yaml_file` refuses each of these with one line
naming the file and line, before anything is expanded. A value PyYAML cannot
build (an integer of more than 4300 digits, which Python refuses to read; a
date such as ``2023-02-30``) is one line naming its line too, not a traceback.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

MAX_CONFIG_BYTES = 256 * 1024
"""Config files (and override values) above this are refused before parsing: a run's config
is a few KiB, and pure-Python YAML parses about 150 KiB a second."""
MAX_YAML_VALUES = 100_000
"""Values a YAML document may expand to, counting each alias as the values it repeats:
bounds "billion laughs" documents, which expand exponentially."""
MAX_YAML_DEPTH = 64
"""Nesting levels a YAML document may have (the composer recurses once per level)."""


class YamlRefused(yaml.MarkedYAMLError):
    """Valid YAML, but beyond what a config may be: too big an expansion, too deep, a duplicate
    key. Unlike a syntax error, an override's value is not then read as a plain string."""


MAX_INT_DIGITS = sys.get_int_max_str_digits() or 4300
"""The longest integer a YAML document may hold, in decimal digits: Python reads no longer one
from text (``sys.get_int_max_str_digits``), nor writes one back, so hexadecimal, octal and
binary integers are held to the same size."""
_MAX_INT_BITS = math.floor(MAX_INT_DIGITS * math.log2(10))


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, bounded: too big an alias expansion, too deep a nesting and an
    alias inside its own anchor are refused while composing, before anything is expanded."""

    def __init__(self, text: str):
        super().__init__(text)
        self._values: dict[int, int] = {}  # id(node) -> values it expands to
        self._open: set[str] = set()  # anchors of collections still being composed
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) and event.anchor in self._open:
            raise self._refuse(f"alias *{event.anchor} is inside the node it names", event)
        anchor = None
        if isinstance(event, yaml.CollectionStartEvent):
            anchor = event.anchor
        if self._depth >= MAX_YAML_DEPTH:
            raise self._refuse(f"nested more than {MAX_YAML_DEPTH} levels deep", event)
        self._depth += 1
        if anchor is not None:
            self._open.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open.discard(anchor)
        self._count(node, event)
        return node

    def _count(self, node: yaml.Node, event: yaml.Event) -> None:
        if id(node) in self._values:  # an alias: counted where its anchor was
            return
        values = 1
        if isinstance(node, yaml.SequenceNode):
            values += sum(self._values[id(item)] for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            values += sum(self._values[id(k)] + self._values[id(v)] for k, v in node.value)
        if values > MAX_YAML_VALUES:
            raise self._refuse(
                f"expands to more than {MAX_YAML_VALUES} values (aliases repeat what they "
                "name); a config needs far fewer",
                event,
            )
        self._values[id(node)] = values

    @staticmethod
    def _refuse(problem: str, event: yaml.Event) -> YamlRefused:
        return YamlRefused(problem=problem, problem_mark=event.start_mark)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """PyYAML's, with a value it cannot build (``int()`` or ``datetime()`` refusing it)
        refused at the value's line instead of escaping as a bare ValueError."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as error:
            raise YamlRefused(
                problem=f"cannot read this value: {error} (quote it to keep it as text)",
                problem_mark=node.start_mark,
            ) from None

    def construct_bounded_int(self, node: yaml.ScalarNode) -> int:
        """An integer of at most :data:`MAX_INT_DIGITS` digits, in any base."""
        digits = sum(character.isalnum() for character in str(node.value))
        value = None if digits > MAX_INT_DIGITS else self.construct_yaml_int(node)
        if value is None or abs(value).bit_length() > _MAX_INT_BITS:
            raise YamlRefused(
                problem=f"an integer of more than {MAX_INT_DIGITS} digits; no config value "
                "needs one (Python reads no longer integer from text)",
                problem_mark=node.start_mark,
            )
        return value


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_bounded_int)


def parse_yaml(text: str) -> tuple[Any, dict[tuple[str, ...], int]]:
    """The data of one YAML document, loaded safely within the bounds above, and the line of
    every key path in it. Raises :class:`yaml.YAMLError` (:class:`YamlRefused` past a bound)."""
    loader = BoundedLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[tuple[str, ...], int] = {}
        if node is not None:
            _key_lines(node, (), lines)  # before construction, which flattens merge keys
        try:
            data = loader.construct_document(node) if node is not None else None
        except YamlRefused as error:
            _name_the_key(error, lines)
            raise
    finally:
        loader.dispose()
    return data, lines


def _name_the_key(error: YamlRefused, lines: dict[tuple[str, ...], int]) -> None:
    """Start the problem of a value that cannot be built with its key (``run.seed: ...``)."""
    line = error.problem_mark.line + 1
    keys = [key for key, at in lines.items() if at == line]
    if keys:
        error.problem = f"{'.'.join(max(keys, key=len))}: {error.problem}"


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _key_lines(node: yaml.Node, prefix: tuple[str, ...], lines: dict) -> None:
    """Record the line of every key path under ``node``; refuse a key given twice in one
    mapping (YAML says keys are unique; PyYAML would silently keep the last)."""
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, Any], yaml.Node] = {}
        for key_node, value_node in node.value:
            keys = (*prefix, str(key_node.value))
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                earlier = first.setdefault((key_node.tag, key_node.value), key_node)
                if earlier is not key_node:
                    raise YamlRefused(
                        problem=f"duplicate key '{'.'.join(keys)}' (YAML keeps only one of them)",
                        problem_mark=key_node.start_mark,
                        note=f"first at line {earlier.start_mark.line + 1}",
                    )
            lines.setdefault(keys, key_node.start_mark.line + 1)
            _key_lines(value_node, keys, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            keys = (*prefix, str(index))
            lines.setdefault(keys, item.start_mark.line + 1)
            _key_lines(item, keys, lines)


class YamlFileError(ValueError):
    """A YAML file that cannot be read as a config; ``str()`` is one line naming it."""


def read_yaml_file(path: Path) -> tuple[Any, dict[tuple[str, ...], int]]:
    """The data of the YAML document at ``path`` and the line of every key path in it."""
    text = _decode(path, _read_bounded(path))
    try:
        return parse_yaml(text)
    except yaml.YAMLError as error:
        raise YamlFileError(_yaml_error_where(path, text, error)) from None


def _read_bounded(path: Path) -> bytes:
    """The file's bytes, refused past :data:`MAX_CONFIG_BYTES` without reading it all."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
            size = os.fstat(file.fileno()).st_size
    except OSError as error:
        raise YamlFileError(f"{path}: cannot read config: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        shown = f"{size / 2**20:.1f} MiB" if size > MAX_CONFIG_BYTES else "more than that"
        raise YamlFileError(
            f"{path}: config file is {shown}; at most {MAX_CONFIG_BYTES // 1024} KiB is read "
            "(a run's config is a few KiB)"
        )
    return data


_WIDE_BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}


def _decode(path: Path, data: bytes) -> str:
    """UTF-8 text (a UTF-8 byte-order mark is dropped), or one line on what the bytes are."""
    for bom, name in _WIDE_BOMS.items():
        if data.startswith(bom):
            raise YamlFileError(f"{path}: config file is {name} text; save it as UTF-8")
    nul = data.find(b"\x00")
    if nul >= 0:
        where = f"{path}:{_line_at(data, nul)}"
        problem = f"NUL byte at offset {nul}: UTF-16/32 or binary, not UTF-8 text"
        raise YamlFileError(f"{where}: {problem}; save the file as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        where = f"{path}:{_line_at(data, error.start)}"
        problem = f"not UTF-8 text: byte 0x{data[error.start]:02x} at offset {error.start}"
        raise YamlFileError(f"{where}: {problem}; save the file as UTF-8") from None


def _line_at(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _yaml_error_where(path: Path, text: str, error: yaml.YAMLError) -> str:
    """``file:line: what`` of a YAML error, on one line."""
    if isinstance(error, yaml.reader.ReaderError):
        line = text.count("\n", 0, error.position) + 1
        return (
            f"{path}:{line}: not valid YAML: character #x{error.character:04x} at offset "
            f"{error.position}: {error.reason}"
        )
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{path}:{mark.line + 1}" if mark else str(path)
    problem = getattr(error, "problem", None) or getattr(error, "context", None) or error
    if isinstance(error, YamlRefused):
        return f"{where}: {problem}" + (f"; {error.note}" if error.note else "")
    return f"{where}: not valid YAML: {problem}"
