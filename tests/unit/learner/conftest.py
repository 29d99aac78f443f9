"""Fixtures shared by the learner's unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncrl.learner.distributed import Ranks
from tests.helpers.learner import single_rank


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    """A process group of one in this process; the environment goes back afterwards."""
    with single_rank() as ranks:
        yield ranks
