"""Fixtures shared by the unit tests."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def bubblewrap() -> None:
    """Fail (not skip) where bwrap is missing: the sandbox refuses to run without it."""
    if shutil.which("bwrap") is None:
        pytest.fail(
            "bubblewrap (bwrap) is not installed, so the sandbox cannot run: "
            "apt-get install bubblewrap (or bash scripts/setup.sh as root)"
        )
