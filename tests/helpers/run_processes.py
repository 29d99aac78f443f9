"""The processes of a launched run, found by its run directory in their command lines."""

from __future__ import annotations

from pathlib import Path

import psutil


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every live process whose command line names ``run_dir`` (the launcher's roles)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if str(run_dir) in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found
