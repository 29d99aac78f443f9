"""Fixtures shared by the unit tests.

The tests mirror the packages (``core/``, ``learner/``, ``buffer/``, ...); a few reuse
another folder's helpers (``from test_episodes import ScriptedBackend``), so every
folder is importable from every other. Test module names are unique across folders.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).parents[1])]  # tests/: helpers shared with the other suites
sys.path[:0] = sorted(
    str(d)
    for d in Path(__file__).parent.iterdir()
    if (d / "conftest.py").exists() or any(d.glob("test_*.py"))
)


@pytest.fixture
def bubblewrap() -> None:
    """Fail (not skip) where bwrap is missing: the sandbox refuses to run without it."""
    if shutil.which("bwrap") is None:
        pytest.fail(
            "bubblewrap (bwrap) is not installed, so the sandbox cannot run: "
            "apt-get install bubblewrap (or bash scripts/setup.sh as root)"
        )
