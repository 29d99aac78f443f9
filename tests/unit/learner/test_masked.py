"""Masked means (``algorithms/masked.py``) against hand-worked examples.

Expected numbers are worked out by hand in the comments, not by re-running the
formula under test.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.algorithms import masked_mean

torch.set_num_threads(1)


# ----------------------------------------------------------- masked mean


def test_masked_mean_averages_only_the_set_positions():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 3) / 3 = 2
    assert masked_mean(values, mask).item() == pytest.approx(2.0)


def test_masked_mean_of_an_empty_mask_is_zero():
    values = torch.tensor([[1.0, 2.0]])
    assert masked_mean(values, torch.zeros(1, 2)).item() == 0.0
