"""The resource limits of a sandboxed call, set by a prelude before the code runs.

The interpreter in the sandbox runs ``python -c PRELUDE CONFIG_JSON``: the
prelude lowers the rlimits of :func:`rlimits` (``RLIMIT_AS``, ``RLIMIT_CPU``,
``RLIMIT_FSIZE``, no core dumps, ``RLIMIT_NOFILE`` and, under bubblewrap,
``RLIMIT_NPROC``), reports on a pipe that it did, and only then runs the code
as ``__main__``. A call whose prelude did not report never counts as run.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Runs inside the sandbox as ``python -c PRELUDE CONFIG_JSON``. Keep it stdlib
# only and free of names that leak into the user's ``__main__``. It is not a
# wall (the code runs in the same process); it only lowers limits, which no
# unprivileged process can raise again.
PRELUDE = r"""
def _asyncrl_sandbox():
    import json, os, resource, sys, types
    cfg = json.loads(sys.argv[1])
    try:
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
    except Exception as exc:
        sys.stderr.write("sandbox: could not set limits: %r\n" % (exc,))
        sys.stderr.flush()
        os._exit(125)
    os.write(cfg["report_fd"], b"rlimits")
    os.close(cfg["report_fd"])

    with open(cfg["main"], encoding="utf-8") as f:
        source = f.read()
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        sys.exit(1)


_asyncrl_sandbox()
"""


def rlimits(
    *,
    timeout_s: float,
    memory_mb: int,
    max_file_mb: int,
    max_open_files: int,
    max_processes: int | None,
) -> list[tuple[str, int, int]]:
    """``(resource name, soft, hard)`` for the prelude; no ``RLIMIT_NPROC`` when
    ``max_processes`` is None (it counts every process of the user outside a user
    namespace)."""
    cpu = math.ceil(timeout_s) + 1
    memory = memory_mb * 1024 * 1024
    files = max_file_mb * 1024 * 1024
    limits = [
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_FSIZE", files, files),
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_NOFILE", max_open_files, max_open_files),
    ]
    if max_processes is not None:
        limits.append(("RLIMIT_NPROC", max_processes, max_processes))
    return limits


def prelude_command(python: str, site_packages: bool, config: dict[str, Any]) -> list[str]:
    """The command line that runs the prelude with ``config`` (its rlimits, the pipe
    to report on, the path of the code): isolated mode, no bytecode, unbuffered,
    UTF-8, and without ``site`` unless ``site_packages``."""
    flags = ["-I", "-B", "-u", "-X", "utf8"] + ([] if site_packages else ["-S"])
    return [python, *flags, "-c", PRELUDE, json.dumps(config)]
