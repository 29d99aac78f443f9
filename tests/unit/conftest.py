"""Fixtures shared by the unit tests.

The tests mirror the packages (``core/``, ``learner/``, ``buffer/``, ...). ``tests/`` is a
package tree: pytest puts the repository root on the import path and imports each test
module by its dotted name (``tests.unit.learner.test_kl``), so names may repeat across
folders, and what several tests share lives in :mod:`tests.helpers`.
"""

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
