"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A zmq context of the test's own, destroyed with every socket left open on it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)
