"""From logits to what the losses consume: token log-probs and entropies.

:func:`head_token_outputs` goes from the hidden states through the LM head without ever
holding every trained token's logits: a 262k vocabulary makes ``[N, V]`` fp32 logits
(and their gradient) the largest tensors of a step, 1 GiB per 1,000 tokens.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Tensor = torch.Tensor
Entropy = Literal["none", "metric", "loss"]
HEAD_CHUNK_ELEMENTS = 1 << 26
"""Logits :func:`head_token_outputs` holds at a time (256 MiB in fp32): rows per chunk are
this over the vocabulary size (256 rows of a 262k vocabulary, 1,365 of a 49k one). A
quarter of it made Gemma-3-270M's step 36% slower instead of 11% (more passes over the
head's weight and its gradient: ``benchmarks/head_memory.py``)."""

ENTROPY_CHUNK_ELEMENTS = 1 << 24
"""Without grad, :func:`entropy_from_logits` works on this many logits at a time (64 MiB fp32)."""


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position.  [B, T, V] -> [B, T]

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, which never forms
    ``log_softmax`` and ``softmax`` together. Gradient mode is the caller's:
    under ``torch.no_grad()`` (a metric) the rows are done in chunks so the
    float32 temporaries stay small; with grad (an entropy bonus) in one pass.
    """
    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])

    def entropy(rows: Tensor) -> Tensor:
        z = rows.float() / temperature
        return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)

    if torch.is_grad_enabled() and logits.requires_grad:
        return entropy(flat).reshape(shape)
    chunk = max(1, ENTROPY_CHUNK_ELEMENTS // max(1, flat.shape[-1]))
    parts = [entropy(flat[start : start + chunk]) for start in range(0, flat.shape[0], chunk)]
    if not parts:
        return torch.zeros(shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).reshape(shape)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-prob of each target token under softmax(logits / temperature).  [B, T, V] -> [B, T]"""
    logits = logits.float() / temperature
    return torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def head_token_outputs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    softcap: float | None = None,
    entropy: Entropy = "none",
) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` [N] (and entropies) under ``softmax(head(hidden) /
    temperature)``, ``head`` the linear layer ``weight`` [V, H], ``bias``, from ``hidden``
    [N, H]: the values of :func:`token_logprobs` and :func:`entropy_from_logits` over the
    head's logits, computed ``HEAD_CHUNK_ELEMENTS`` logits at a time.

    Tokens whose logits fit in one chunk are computed as one, as the head itself would.
    More are cut into chunks, and with grad each chunk is checkpointed: its logits are
    dropped after the forward and computed again in the backward, so neither pass ever
    holds more than one chunk's fp32 logits and their softmax. ``softcap``: the model's
    final logit soft-capping (``cap * tanh(logits / cap)``, Gemma's), applied before the
    temperature. The entropy gets a gradient only as a ``"loss"`` term.
    """
    rows = max(1, HEAD_CHUNK_ELEMENTS // max(1, weight.shape[0]))
    if hidden.shape[0] <= rows:  # one chunk: kept for the backward, nothing recomputed
        part, part_entropy = _head_chunk(
            hidden, weight, bias, targets, temperature, softcap, entropy
        )
        return part, None if entropy == "none" else part_entropy
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], rows):
        args = (hidden[start : start + rows], weight, bias, targets[start : start + rows])
        options = (temperature, softcap, entropy)
        if grad:
            part, part_entropy = checkpoint(_head_chunk, *args, *options, use_reentrant=False)
        else:
            part, part_entropy = _head_chunk(*args, *options)
        logprobs.append(part)
        entropies.append(part_entropy)
    if not logprobs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, None if entropy == "none" else empty
    return torch.cat(logprobs), None if entropy == "none" else torch.cat(entropies)


def _head_chunk(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    softcap: float | None,
    entropy: Entropy,
) -> tuple[Tensor, Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    z = logits / temperature
    normalizer = torch.logsumexp(z, -1)
    logprobs = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    if entropy == "none":
        return logprobs, logprobs.new_zeros(0)
    if entropy == "metric":  # no grad, in smaller pieces than the chunk: no [rows, V] copies
        with torch.no_grad():
            return logprobs, entropy_from_logits(logits, temperature)
    return logprobs, normalizer - (torch.softmax(z, -1) * z).sum(-1)
