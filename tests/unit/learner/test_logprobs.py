"""Token log-probs and entropies from logits (``algorithms/logprobs.py``) against
hand-worked examples: temperature, float32 from half precision, entropy in chunks.

Expected numbers are worked out by hand in the comments, not by re-running the
formula under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner import algorithms
from asyncrl.learner.algorithms import entropy_from_logits, token_logprobs
from tests.helpers.tensors import close

torch.set_num_threads(1)


# -------------------------------------------------------- token logprobs


def test_token_logprobs_gathers_the_log_softmax_of_the_target_tokens():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 6)
    targets = torch.randint(0, 6, (2, 4))
    got = token_logprobs(logits, targets)
    for b in range(2):
        for t in range(4):
            row = logits[b, t]
            # log p = z_y - log sum_j exp z_j
            expected = row[targets[b, t]] - torch.logsumexp(row, dim=0)
            assert got[b, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_token_logprobs_divides_logits_by_the_temperature():
    logits = torch.tensor([[[2.0, 0.0]]])
    targets = torch.tensor([[0]])
    # at T = 0.5 the logits become [4, 0]: log p(0) = 4 - log(e^4 + 1)
    expected = 4.0 - math.log(math.exp(4.0) + 1.0)
    got = token_logprobs(logits, targets, temperature=0.5)
    assert got.item() == pytest.approx(expected, abs=1e-6)
    # and at T = 1: 2 - log(e^2 + 1)
    assert token_logprobs(logits, targets).item() == pytest.approx(
        2.0 - math.log(math.exp(2.0) + 1.0), abs=1e-6
    )


def test_token_logprobs_computes_in_float32_from_half_precision_logits():
    logits = torch.tensor([[[1.0, 3.0, -1.0]]], dtype=torch.bfloat16)
    got = token_logprobs(logits, torch.tensor([[1]]))
    assert got.dtype == torch.float32
    # 3 - log(e^1 + e^3 + e^-1)
    expected = 3.0 - math.log(math.exp(1.0) + math.exp(3.0) + math.exp(-1.0))
    assert got.item() == pytest.approx(expected, abs=1e-5)


# --------------------------------------------------------------- entropy


def test_entropy_of_hand_worked_distributions():
    # uniform over 2: log 2. p = [1/4, 3/4] from logits [log 1, log 3]:
    # H = -(1/4 log 1/4 + 3/4 log 3/4) = log 4 - 3/4 log 3
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    expected = [[math.log(2.0), math.log(4.0) - 0.75 * math.log(3.0)]]
    close(entropy_from_logits(logits), expected, atol=1e-6)
    # temperature 2 on doubled logits gives the same distribution
    close(entropy_from_logits(2 * logits, temperature=2.0), expected, atol=1e-6)


def test_entropy_is_float32_from_bfloat16_and_chunks_without_grad():
    torch.manual_seed(3)
    logits = torch.randn(3, 5, 7)
    with torch.no_grad():
        got = entropy_from_logits(logits.to(torch.bfloat16))
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    # a sharp (nearly one-hot) row has entropy near 0; a flat one log V
    sharp = torch.tensor([[[100.0, 0.0, 0.0]]])
    flat = torch.zeros(1, 1, 3)
    assert entropy_from_logits(sharp).item() == pytest.approx(0.0, abs=1e-6)
    assert entropy_from_logits(flat).item() == pytest.approx(math.log(3.0), abs=1e-6)


def test_entropy_in_chunks_equals_one_pass_and_grad_flows_for_a_bonus(monkeypatch):
    torch.manual_seed(4)
    logits = torch.randn(2, 3, 8)
    with_grad = logits.clone().requires_grad_(True)
    bonus = entropy_from_logits(with_grad)  # with grad: one pass
    # without grad, 16 elements per chunk is 2 rows of V = 8: the 6 rows take 3 chunks
    monkeypatch.setattr(algorithms.logprobs, "ENTROPY_CHUNK_ELEMENTS", 16)
    with torch.no_grad():
        chunked = entropy_from_logits(logits)
    torch.testing.assert_close(bonus.detach(), chunked)
    bonus.sum().backward()
    assert torch.isfinite(with_grad.grad).all() and with_grad.grad.abs().sum() > 0
