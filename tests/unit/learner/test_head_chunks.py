"""The LM head a chunk of tokens at a time: the same log-probs, entropies and gradients as
the whole ``[N, V]`` logits give, without ever keeping more than one chunk's logits."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.algorithms import (
    entropy_from_logits,
    head_token_outputs,
    token_logprobs,
)
from asyncrl.learner.algorithms import (
    logprobs as logprobs_module,
)

N, H, V = 37, 16, 500


def whole(hidden, weight, bias, targets, temperature, softcap):
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logprobs = token_logprobs(logits[None], targets[None], temperature)[0]
    return logprobs, entropy_from_logits(logits, temperature)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(logprobs_module, "HEAD_CHUNK_ELEMENTS", 8 * V)  # 5 chunks of N


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=generator, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, H, generator=generator, dtype=torch.float64).requires_grad_()
    bias = torch.randn(V, generator=generator, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=generator)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.7, None), (1.0, 3.0)])
def test_chunks_give_the_whole_head_s_values_and_gradients(temperature, softcap):
    hidden, weight, bias, targets = inputs()
    ours, our_entropy = head_token_outputs(
        hidden, weight, bias, targets, temperature, softcap, entropy="loss"
    )
    theirs, their_entropy = whole(hidden, weight, bias, targets, temperature, softcap)
    torch.testing.assert_close(ours, theirs.float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(our_entropy, their_entropy.float(), rtol=0, atol=1e-5)
    weights = torch.linspace(-1, 1, N, dtype=torch.float32)
    ours_grad = torch.autograd.grad(
        (ours * weights).sum() + our_entropy.sum(), (hidden, weight, bias)
    )
    theirs_grad = torch.autograd.grad(
        (theirs.float() * weights).sum() + their_entropy.float().sum(), (hidden, weight, bias)
    )
    for a, b in zip(ours_grad, theirs_grad, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_metric_entropy_gets_no_gradient_and_none_is_none():
    hidden, weight, bias, targets = inputs(1)
    logprobs, entropy = head_token_outputs(hidden, weight, bias, targets, entropy="metric")
    assert not entropy.requires_grad and logprobs.requires_grad
    assert head_token_outputs(hidden, weight, bias, targets, entropy="none")[1] is None
    empty, _ = head_token_outputs(hidden[:0], weight, bias, targets[:0], entropy="metric")
    assert empty.shape == (0,)


def test_the_backward_keeps_no_logits_only_the_chunks_inputs(monkeypatch):
    hidden, weight, bias, targets = inputs(2)
    saved: dict[int, int] = {}  # storage -> elements kept for the backward

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr() + tensor.storage_offset()] = tensor.numel()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = head_token_outputs(hidden, weight, bias, targets, entropy="loss")
    # the inputs (hidden, weight, bias, targets: 9,129 elements), no chunk's [8, V] logits
    assert saved and sum(saved.values()) < N * V // 2, sum(saved.values())
    logprobs.sum().backward()
    assert hidden.grad is not None and weight.grad is not None
