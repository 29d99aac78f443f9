"""From logits to what the losses consume: token log-probs and entropies."""

from __future__ import annotations

import torch

Tensor = torch.Tensor

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
