"""Validation errors as one line each: where the key came from, the key, what was
expected, and for an unknown key the closest valid one."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from asyncrl.config.algorithm import AlgorithmConfig, algorithm_keys
from asyncrl.config.base import shorten
from asyncrl.config.schema import Config


def describe(error: dict[str, Any], origins: dict[tuple[str, ...], str]) -> str:
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(loc) or "(top level)"
    where = origin(loc, origins)
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key '{key}'{_suggestion(loc)}"
    if error["type"] == "missing":
        return f"{where}: missing required key '{key}'"
    message = error["msg"].removeprefix("Value error, ")
    if "input" in error and error["type"] != "value_error" and not isinstance(error["input"], dict):
        message += f", got {_shown(error['input'])}"
    return f"{where}: {key}: {message}"


def _shown(value: Any) -> str:
    """``repr(value)`` cut short; an integer too long for Python to write out is named by
    its size instead (``repr`` refuses one of more than 4300 digits)."""
    try:
        return shorten(repr(value), 80)
    except ValueError:
        return f"an integer of {value.bit_length()} bits"


def origin(loc: tuple[str, ...], origins: dict[tuple[str, ...], str]) -> str:
    for end in range(len(loc), 0, -1):
        if loc[:end] in origins:
            return origins[loc[:end]]
    return "config"


def _suggestion(loc: tuple[str, ...]) -> str:
    """Closest valid key: in the same section, else any key with a similar leaf name."""
    section = _model_at(loc[:-1])
    if section is not None:
        close = difflib.get_close_matches(loc[-1], _keys(section), n=1, cutoff=0.6)
        if close:
            return f"; did you mean '{'.'.join((*loc[:-1], close[0]))}'?"
    leaves = {path[-1]: path for path in _all_paths(Config)}
    close = difflib.get_close_matches(loc[-1], list(leaves), n=1, cutoff=0.75)
    if close:
        return f"; did you mean '{'.'.join(leaves[close[0]])}'?"
    if section is not None:
        return f"; valid keys here: {', '.join(_keys(section))}"
    return ""


def _keys(section: type[BaseModel]) -> list[str]:
    """The keys a section takes; the algorithm's, of every registered estimator."""
    if issubclass(section, AlgorithmConfig):
        return algorithm_keys()
    return list(section.model_fields)


def _model_at(loc: tuple[str, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        sub = _section_type(field.annotation)
        if sub is None:
            return None
        model = sub
    return model


def _section_type(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _all_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    if issubclass(model, AlgorithmConfig):
        return [(*prefix, key) for key in algorithm_keys()]
    for name, field in model.model_fields.items():
        sub = _section_type(field.annotation)
        paths += _all_paths(sub, (*prefix, name)) if sub else [(*prefix, name)]
    return paths
