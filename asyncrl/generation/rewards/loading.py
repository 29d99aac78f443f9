"""Which function scores a row: a built-in by ``data_source`` (:mod:`.sources`), or
``reward.function`` by name (``module:function`` or ``path/to/file.py:function``)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from asyncrl.generation.rewards.sources import (
    RewardFunction,
    builtin_reward_function,
    known_data_sources,
)


class RewardFunctionError(ValueError):
    """A ``reward.function`` that cannot be loaded; the message says why."""


def load_reward_function(spec: str) -> RewardFunction:
    """The function named ``module:function`` or ``path/to/file.py:function``.

    A file is loaded as a module of its own (relative paths from the current
    directory). Raises :class:`RewardFunctionError` naming what is wrong.
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise RewardFunctionError(
            f"reward function '{spec}': expected module:function or path/to/file.py:function"
        )
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise RewardFunctionError(f"reward function '{spec}': no such file {path}")
        digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
        module_name = f"asyncrl_reward_{digest}_{path.stem}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise RewardFunctionError(f"reward function '{spec}': cannot load {path}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException as error:
                del sys.modules[module_name]
                raise RewardFunctionError(
                    f"reward function '{spec}': loading {path} raised "
                    f"{type(error).__name__}: {error}"
                ) from error
        source = str(path)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise RewardFunctionError(
                f"reward function '{spec}': cannot import module '{where}': {error}"
            ) from error
        source = f"module '{where}'"
    if not hasattr(module, name):
        defined = sorted(
            key
            for key, value in vars(module).items()
            if callable(value) and not key.startswith("_")
        )
        raise RewardFunctionError(
            f"reward function '{spec}': {source} has no '{name}' "
            f"(callables there: {', '.join(defined) or 'none'})"
        )
    function = getattr(module, name)
    if not callable(function):
        raise RewardFunctionError(
            f"reward function '{spec}': '{name}' in {source} is a "
            f"{type(function).__name__}, not a function"
        )
    return function


def check_reward_sources(function: str | None, data_sources: Iterable[str]) -> None:
    """Fail early when some rows could not be scored: a bad ``reward.function``,
    or (with none) a ``data_source`` that has no built-in reward function."""
    if function:
        load_reward_function(function)
        return
    unknown = sorted({source for source in data_sources if not builtin_reward_function(source)})
    if unknown:
        raise RewardFunctionError(
            f"no built-in reward function for data_source {', '.join(map(repr, unknown))}; "
            f"built in: {known_data_sources()}. "
            "Set reward.function=module:function or path/to/file.py:function"
        )
