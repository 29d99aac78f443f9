"""Which interpreter runs in the sandbox, and what of the host it needs to see.

The interpreter must be one the sandbox user can reach (:func:`default_python`);
its install tree is bound read-only when it is outside ``/usr``, and every
``site-packages``/``dist-packages`` directory is listed so that bubblewrap can
hide it (:func:`interpreter_layout`). The results are kept per process: the
host's layout does not change under a running trainer.
"""

from __future__ import annotations

import glob
import os
import sys
import sysconfig

FALLBACK_PYTHON = "/usr/bin/python3"
"""The sandbox's interpreter when this process's own cannot be reached by the
sandbox user (e.g. a pyenv build under ``/root``, mode 0700)."""


def _can_reach(path: str, uid: int | None, gid: int | None, mode: int) -> bool:
    """Whether ``uid``/``gid`` (no supplementary groups) can search every directory
    above ``path`` and has ``mode`` (``os.R_OK | os.X_OK`` ...) on ``path`` itself;
    ``uid`` None: this process, by ``os.access``."""
    if uid is None:
        return os.access(path, mode)
    parts = os.path.abspath(path).split(os.sep)
    checks = [(os.sep.join(parts[:i]) or os.sep, os.X_OK) for i in range(1, len(parts))]
    for where, want in [*checks, (path, mode)]:
        try:
            st = os.stat(where)
        except OSError:
            return False
        if uid == 0:
            continue
        if st.st_uid == uid:
            bits = (st.st_mode >> 6) & 7
        elif st.st_gid == gid:
            bits = (st.st_mode >> 3) & 7
        else:
            bits = st.st_mode & 7
        if (want & os.R_OK and not bits & 4) or (want & os.X_OK and not bits & 1):
            return False
    return True


_DEFAULT_PYTHON: dict[tuple[int | None, int | None], str] = {}


def default_python(uid: int | None = None, gid: int | None = None) -> str:
    """This process's interpreter, resolved (a venv's ``python`` is a link to its
    base), when ``uid``/``gid`` (None: this process's user) can run it and read
    its standard library; else :data:`FALLBACK_PYTHON`."""
    key = (uid, gid)
    if key not in _DEFAULT_PYTHON:
        own = os.path.realpath(sys.executable)
        stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
        reachable = _can_reach(own, uid, gid, os.R_OK | os.X_OK) and _can_reach(
            stdlib, uid, gid, os.R_OK | os.X_OK
        )
        _DEFAULT_PYTHON[key] = own if reachable else FALLBACK_PYTHON
    return _DEFAULT_PYTHON[key]


_LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}


def interpreter_layout(python: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(trees to bind read-only, package directories to hide)`` for running
    ``python`` in the sandbox. The tree is the interpreter's install prefix when it
    is outside ``/usr``; the hidden directories are every ``site-packages`` and
    ``dist-packages`` of ``/usr``, ``/usr/local`` and that prefix."""
    if python in _LAYOUTS:
        return _LAYOUTS[python]
    real = os.path.realpath(python)
    if real == os.path.realpath(sys.executable):
        prefix = os.path.realpath(sys.base_prefix)
    else:
        prefix = os.path.dirname(os.path.dirname(real))
    binds: tuple[str, ...] = ()
    if not _under(real, "/usr"):
        binds = (prefix,)
    hidden: list[str] = []
    for root in dict.fromkeys(["/usr", "/usr/local", *binds]):
        for pattern in (
            "lib*/python3*/site-packages",
            "lib*/python3*/dist-packages",
            "lib*/python3/dist-packages",
        ):
            for path in sorted(glob.glob(os.path.join(root, pattern))):
                path = os.path.realpath(path)
                if (
                    os.path.isdir(path)
                    and path not in hidden
                    and any(_under(path, tree) for tree in ("/usr", *binds))
                ):
                    hidden.append(path)
    _LAYOUTS[python] = (binds, tuple(hidden))
    return _LAYOUTS[python]


_ROOT_LINKS: list[str] = []


def root_links() -> list[str]:
    """bwrap arguments for ``/bin``, ``/lib``, ``/lib64``, ...: the host's links into
    ``/usr`` (a merged-``/usr`` system: ``--symlink usr/lib /lib``), or the host's
    directories read-only where they are not links."""
    if not _ROOT_LINKS:
        links: list[str] = []
        for path in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
            if os.path.islink(path):
                links += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                links += ["--ro-bind", path, path]
        _ROOT_LINKS[:] = links
    return list(_ROOT_LINKS)


def _under(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")
