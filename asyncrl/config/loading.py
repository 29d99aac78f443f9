"""Loading: YAML files and ``key.path=value`` overrides into a validated :class:`Config`,
with every problem reported at once (see :mod:`asyncrl.config`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from asyncrl.config.algorithm import SAVED_RUN
from asyncrl.config.base import ConfigError, shorten, spec_file
from asyncrl.config.errors import describe, origin
from asyncrl.config.schema import Config
from asyncrl.core.yaml_files import (
    MAX_CONFIG_BYTES,
    YamlFileError,
    YamlRefused,
    parse_yaml,
    read_yaml_file,
)


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    *,
    dropped: list[str] | None = None,
) -> Config:
    """Read YAML at ``path`` (optional), apply ``key.path=value`` overrides, validate.

    ``dropped``: ``path`` is a config asyncrl saved (``RUN_DIR/config.yaml``); knobs an
    earlier version saved for estimators the run does not use are dropped and named in
    this list instead of refused (:data:`~asyncrl.config.algorithm.SAVED_RUN`).
    """
    raw: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    problems: list[str] = []
    if path is not None:
        raw, origins = _read_yaml(Path(path))
    for override in overrides or []:
        try:
            keys, value = _parse_override(override)
        except ValueError as error:
            problems.append(str(error))
            continue
        _set_path(raw, keys, value)
        label = f"override '{shorten(override)}'"
        for key in [k for k in origins if k[: len(keys)] == keys]:
            del origins[key]  # replaced by the override: file lines no longer apply
        for end in range(1, len(keys)):
            origins.setdefault(keys[:end], label)
        origins[keys] = label
    if problems:
        raise ConfigError(problems)
    try:
        context = None if dropped is None else {SAVED_RUN: dropped}
        config = Config.model_validate(raw, context=context)
    except ValidationError as error:
        raise ConfigError([describe(e, origins) for e in error.errors()]) from None
    problems = _missing_files(config, origins)
    if problems:
        raise ConfigError(problems)
    return config


def config_from_dict(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as error:
        raise ConfigError([describe(e, {}) for e in error.errors()]) from None


def save_config(config: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))


def _missing_files(config: Config, origins: dict[tuple[str, ...], str]) -> list[str]:
    """Plug-ins named by file (`path/to/file.py:name`) whose file is not there. Checked when a
    config is loaded for a launch or `validate`, not by the schema: a run's saved config is
    read again from other directories and machines, where relative paths mean other files."""
    specs: list[tuple[tuple[str, ...], str]] = []
    if config.reward.function is not None:
        specs.append((("reward", "function"), config.reward.function))
    environment = config.environment
    if environment is not None:
        specs.append((("environment", "name"), environment.name))
        specs += [(("environment", "tools", str(i)), t) for i, t in enumerate(environment.tools)]
    problems = []
    for loc, spec in specs:
        file = spec_file(spec)
        if file is not None and not file.is_file():
            where = origin(loc, origins)
            problems.append(
                f"{where}: {'.'.join(loc)}: no such file {str(file)!r} (from {spec!r}; "
                f"relative paths are read from {os.getcwd()})"
            )
    return problems


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    try:
        raw, lines = read_yaml_file(path)
    except YamlFileError as error:
        raise ConfigError([str(error)]) from None
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise ConfigError([f"{path}: expected a mapping of sections at the top level"])
    return raw, {keys: f"{path}:{line}" for keys, line in lines.items()}


def _parse_override(text: str) -> tuple[tuple[str, ...], Any]:
    key, sep, value = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(
            f"override '{shorten(text)}': expected key.path=value, e.g. buffer.max_staleness=2"
        )
    if len(value.encode(errors="replace")) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"override '{shorten(text)}': the value is over {MAX_CONFIG_BYTES // 1024} KiB"
        )
    try:
        parsed = parse_yaml(value)[0] if value else ""
    except YamlRefused as error:
        raise ValueError(f"override '{shorten(text)}': {error.problem}") from None
    except yaml.YAMLError:
        parsed = value  # not YAML: the text itself, e.g. a string holding ': '
    return tuple(key.split(".")), parsed


def _set_path(raw: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    node = raw
    for key in keys[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value


# --------------------------------------------------------------------------
