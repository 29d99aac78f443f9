"""PPO's clipped value loss (``algorithms/value.py``) against hand-worked examples.

Expected numbers are worked out by hand in the comments, not by re-running the
formula under test.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.algorithms import value_loss

torch.set_num_threads(1)


# ------------------------------------------------------------ value loss


def _value_loss_one(v: float, old: float, ret: float, clip: float | None = 0.2):
    values = torch.tensor([[v]], requires_grad=True)
    loss, stats = value_loss(
        values, torch.tensor([[old]]), torch.tensor([[ret]]), torch.ones(1, 1), clip=clip
    )
    loss.backward()
    return loss.item(), values.grad.item(), stats


def test_value_loss_takes_the_clipped_branch_when_it_is_larger():
    # v 1.5, old 1.0, R 2, clip 0.2: clipped v = 1.2
    # (1.5 - 2)^2 = 0.25 < (1.2 - 2)^2 = 0.64 -> 0.5 * 0.64 = 0.32, no gradient (clip saturated)
    loss, grad, stats = _value_loss_one(1.5, 1.0, 2.0)
    assert (loss, grad) == (pytest.approx(0.32, abs=1e-6), 0.0)
    assert stats["value_clip_frac"].item() == 1.0
    assert stats["value_error"].item() == pytest.approx(0.25, abs=1e-6)


def test_value_loss_takes_the_unclipped_branch_when_it_is_larger():
    # v 3, old 1, R 2: clipped v = 1.2; (3 - 2)^2 = 1 > (1.2 - 2)^2 = 0.64 -> 0.5, grad v - R = 1
    loss, grad, stats = _value_loss_one(3.0, 1.0, 2.0)
    assert (loss, grad) == (pytest.approx(0.5, abs=1e-6), pytest.approx(1.0, abs=1e-6))
    assert stats["value_clip_frac"].item() == 0.0
    # inside the clip range both branches agree: v 1.1 -> 0.5 * 0.81, gradient 1.1 - 2 = -0.9
    loss, grad, _ = _value_loss_one(1.1, 1.0, 2.0)
    assert (loss, grad) == (pytest.approx(0.405, abs=1e-6), pytest.approx(-0.9, abs=1e-6))


def test_value_loss_without_clip_is_half_the_squared_error():
    # v 1.5, R 2: 0.5 * 0.25 = 0.125, gradient v - R = -0.5
    loss, grad, stats = _value_loss_one(1.5, 1.0, 2.0, clip=None)
    assert (loss, grad) == (pytest.approx(0.125, abs=1e-6), pytest.approx(-0.5, abs=1e-6))
    assert stats["value_clip_frac"].item() == 0.0


def test_value_loss_aggregates_over_valid_tokens_and_of_all_masked_is_zero():
    values = torch.tensor([[1.0, 3.0, 50.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # no clip: 0.5 * ((1 - 2)^2 + (3 - 2)^2) / 2 tokens = 0.5
    loss, stats = value_loss(values, values.detach(), returns, mask, clip=None)
    assert loss.item() == pytest.approx(0.5)
    assert stats["value_error"].item() == pytest.approx(1.0)
    empty, stats = value_loss(values, values.detach(), returns, torch.zeros(1, 3))
    empty.backward()
    assert empty.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(1, 3))
    assert all(torch.isfinite(v) for v in stats.values())
