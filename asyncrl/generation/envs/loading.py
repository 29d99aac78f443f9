"""Load plug-ins named in a config: ``module:attr`` or ``path/to/file.py:attr``.

``load_object("my_pkg.envs:GuessEnv")`` imports ``my_pkg.envs`` and returns
its ``GuessEnv``; ``load_object("examples/custom_env.py:GuessNumberEnv")``
loads that file as a module first. Every failure is a :class:`PluginError`
whose message says what was asked for and what went wrong, so a typo in a
config stops the run with one readable line instead of a traceback.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


class PluginError(ValueError):
    """A plug-in named in the config cannot be found, imported or built."""


def _import_file(path_text: str, what: str, spec: str) -> Any:
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise PluginError(f"{what} {spec!r}: no file {path}")
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"asyncrl_plugin_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise PluginError(f"{what} {spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise PluginError(f"{what} {spec!r}: loading {path} failed: {exc!r}") from exc
    return module


def _import_module(module_name: str, what: str, spec: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise PluginError(
                f"{what} {spec!r}: no module named {exc.name!r} "
                f"(is it installed, or on PYTHONPATH?)"
            ) from exc
        raise PluginError(f"{what} {spec!r}: importing {module_name!r} failed: {exc}") from exc
    except Exception as exc:
        raise PluginError(f"{what} {spec!r}: importing {module_name!r} failed: {exc!r}") from exc


def load_object(spec: str, *, what: str = "plug-in") -> Any:
    """The object ``spec`` names: ``module:attr`` or ``file.py:attr`` (attr may be dotted)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PluginError(f"{what} {spec!r}: expected 'module:Name' or 'path/to/file.py:Name'")
    location, _, attribute = spec.rpartition(":")
    if not location or not attribute:
        raise PluginError(f"{what} {spec!r}: expected 'module:Name' or 'path/to/file.py:Name'")
    if location.endswith(".py") or "/" in location or "\\" in location:
        module = _import_file(location, what, spec)
    else:
        module = _import_module(location, what, spec)
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            public = sorted(n for n in vars(module) if not n.startswith("_"))
            hint = f"; it has: {', '.join(public[:20])}" if public else ""
            raise PluginError(
                f"{what} {spec!r}: {location!r} has no attribute {attribute!r}{hint}"
            ) from None
    return obj
