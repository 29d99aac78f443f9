"""Every test under tests/gpu/ is marked ``gpu`` and skipped, saying why, where torch
sees no CUDA device: they cover the CUDA paths (NCCL, bf16 FSDP2, device-side collate)
that the CPU suite cannot reach, and run whenever a GPU machine is at hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # a conftest's hook sees the whole session's items: touch only this folder's
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
