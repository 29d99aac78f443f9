"""Comparing a computed tensor with the numbers a test writes down."""

from __future__ import annotations

import torch


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    """``actual`` (as float32) equals ``expected`` (numbers, nested lists or a tensor, as
    float32) to within ``atol`` absolutely, with no relative slack."""
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0)
