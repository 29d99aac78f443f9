"""Token losses [B, T] to one number, with *global* normalizers so that micro-batch
losses summed over gradient accumulation and data-parallel ranks equal the full-batch
loss. Each mode is registered in :data:`~.registry.AGGREGATIONS`."""

from __future__ import annotations

import torch

from asyncrl.learner.algorithms.registry import AGGREGATIONS, register_aggregation

Tensor = torch.Tensor
Normalizer = float | Tensor | None


def _normalizer(given: float | Tensor | None, default: float | Tensor) -> float | Tensor:
    """``given`` (a global count), else the local ``default``; never below 1."""
    value = default if given is None else given
    if isinstance(value, Tensor):
        return value.float().clamp(min=1.0)
    return max(float(value), 1.0)


def _rows_with_tokens(mask: Tensor) -> Tensor:
    """Rows with at least one valid token: the seq-mean modes' local count (as verl, an
    all-masked row is no sequence)."""
    return mask.any(-1).sum()


@register_aggregation("token-mean")
def token_mean(values: Tensor, mask: Tensor, num_tokens: Normalizer, **_: Normalizer) -> Tensor:
    """``sum(x * m) / num_tokens`` (default: valid tokens here)."""
    return values.sum() / _normalizer(num_tokens, mask.sum())


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(
    values: Tensor, mask: Tensor, num_sequences: Normalizer, **_: Normalizer
) -> Tensor:
    """``sum_b mean_t(x_b) / num_sequences``; a row with no valid token contributes 0."""
    lengths = mask.sum(-1).clamp(min=1).to(values.dtype)
    return (values.sum(-1) / lengths).sum() / _normalizer(num_sequences, _rows_with_tokens(mask))


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(
    values: Tensor, mask: Tensor, num_sequences: Normalizer, **_: Normalizer
) -> Tensor:
    """``sum_b sum_t(x_b) / num_sequences``."""
    return values.sum() / _normalizer(num_sequences, _rows_with_tokens(mask))


@register_aggregation("seq-mean-token-sum-norm", counts_empty_rows=True)
def seq_mean_token_sum_norm(
    values: Tensor,
    mask: Tensor,
    num_sequences: Normalizer,
    norm_length: Normalizer,
    **_: Normalizer,
) -> Tensor:
    """Dr. GRPO: ``sum(x * m) / (num_sequences * norm_length)``, a constant normalizer
    free of length bias (default ``norm_length``: T here)."""
    B, T = mask.shape
    length = _normalizer(norm_length, T)
    return values.sum() / (_normalizer(num_sequences, B) * length)


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | Tensor | None = None,
    num_sequences: float | Tensor | None = None,
    norm_length: int | None = None,
) -> Tensor:
    """Reduce per-token losses [B, T] to a scalar.

    Every mode is a sum over this input's rows divided by a normalizer, so a
    batch split into micro-batches (and over data-parallel ranks) gives the
    full-batch loss and gradient when the losses are *summed* and each call
    gets the *global* normalizers:

    - ``token-mean``: ``sum(x * m) / num_tokens`` (default: valid tokens here);
    - ``seq-mean-token-mean``: ``sum_b mean_t(x_b) / num_sequences``; a row
      with no valid token contributes 0 (default ``num_sequences``: the rows here
      with a valid token, as verl);
    - ``seq-mean-token-sum``: ``sum_b sum_t(x_b) / num_sequences`` (same default);
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): ``sum(x * m) / (num_sequences *
      norm_length)``, a constant normalizer free of length bias (default
      ``norm_length``: T here).

    Masked positions never contribute, not even a NaN. All-masked gives 0.
    """
    chosen = AGGREGATIONS[mode]
    mask = mask.bool()
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    return chosen.fn(
        values, mask, num_tokens=num_tokens, num_sequences=num_sequences, norm_length=norm_length
    )
