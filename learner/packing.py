"""How a micro-batch's rows become one forward pass, and where its outputs go back.

A GRPO batch holds ``group_size`` responses to each prompt, right-padded to the
longest row. Run as it is, the model computes every prompt ``group_size`` times
and every padding position once; on the arithmetic task (33-token prompts,
8 responses of 1-32 tokens) that is 2,048 positions for 1,577 real tokens, of
which only the 544 response tokens are trained on.

:func:`packed_input` lays the rows out differently: the rows that share a
context (the tokens before their first trained one, the prompt) become one
packed sequence ``[context, response 1, response 2, ...]`` in which each
response sees the context and itself and nothing else (a 4-D attention mask),
at the positions it has in its own row (``position_ids``). The context runs
once; padding is only what is left at the end of the shortest packed sequences.
Gradients from every response reach the shared context through the attention,
as they would through each row's own copy: the loss and its gradient are those
of the padded batch up to float rounding (``tests/unit/learner/test_packing.py``).

:func:`padded_input` is today's layout: one row each, right-padded.

Either way only the hidden states that predict a trained token go through the
LM head (:func:`token_outputs`): ``[N, V]`` logits for the ``N`` trained tokens
instead of ``[B, L, V]`` for every position, prompt and padding included, and not even
those at once: a plain linear head is applied a chunk of tokens at a time, each chunk's
logits recomputed in the backward (:func:`~asyncrl.learner.algorithms.head_token_outputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from asyncrl.learner.algorithms import (
    entropy_from_logits,
    head_token_outputs,
    token_logprobs,
)
from asyncrl.learner.algorithms import logprobs as head_chunks
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.microbatch import MicroBatch
from asyncrl.learner.sharding import PolicyWithValueHead, language_model

CHUNKED_HEAD = True
"""Apply a plain linear LM head a chunk of tokens at a time when the trained tokens' logits
would take more than ``HEAD_CHUNK_ELEMENTS`` (:func:`token_outputs`); off only to measure
what holding every trained token's logits costs (``benchmarks/head_memory.py``)."""
MIN_PACK_LENGTH = 1024
"""Packed sequences are cut at the longest row of the micro-batch or this many tokens,
whichever is more: attention over a packed sequence is dense, so its cost grows with
the square of the length, while the rest of the model's work does not."""


@dataclass(frozen=True)
class ModelInput:
    """One forward pass of a micro-batch, and where each trained token's output goes.

    ``source[i]`` is the flat position (in ``input_ids.reshape(-1)``) of the hidden
    state that predicts trained token ``i``; ``rows[i], cols[i]`` its place in the
    micro-batch's ``[b, width - 1]`` per-token fields; ``targets[i]`` the token.
    """

    input_ids: Tensor  # [S, L]
    attention_mask: Tensor  # [S, L] padding, or [S, 1, L, L] who may see whom
    position_ids: Tensor | None  # [S, L], None: 0, 1, 2, ... in each row
    source: Tensor  # [N]
    rows: Tensor  # [N]
    cols: Tensor  # [N]
    targets: Tensor  # [N]
    shape: tuple[int, int]  # (b, width - 1): the per-token layout outputs go back to

    @property
    def positions(self) -> int:
        """Positions the model runs on, padding included."""
        return self.input_ids.numel()


@dataclass(frozen=True)
class TokenOutputs:
    """Per-token results in the micro-batch's ``[b, width - 1]`` layout; 0 where no
    token is trained."""

    logprobs: Tensor
    entropy: Tensor | None
    values: Tensor | None


def trained_positions(part: MicroBatch, batch: TrainBatch) -> tuple[Tensor, Tensor]:
    """``(rows, cols)`` of the tokens this micro-batch trains on: where the loss mask is
    set, in the micro-batch's per-token layout (row-major, so sorted)."""
    mask = part.tokens(batch.loss_mask, torch.device("cpu"))
    rows, cols = (mask > 0).nonzero(as_tuple=True)
    if rows.numel() == 0:  # a zero-weight filler still runs the model (FSDP's collectives)
        rows, cols = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    return rows, cols


def padded_input(part: MicroBatch, batch: TrainBatch, device: torch.device) -> ModelInput:
    """The rows as they are, right-padded to the longest."""
    input_ids, attention_mask = part.input(batch, torch.device("cpu"))
    rows, cols = trained_positions(part, batch)
    width = part.width
    return ModelInput(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        position_ids=None,
        source=(rows * width + cols).to(device),
        rows=rows.to(device),
        cols=cols.to(device),
        targets=input_ids[rows, cols + 1].to(device),
        shape=(len(part.rows), width - 1),
    )


def packed_input(
    part: MicroBatch,
    batch: TrainBatch,
    device: torch.device,
    mask_dtype: torch.dtype = torch.bool,
    max_length: int | None = None,
) -> ModelInput:
    """Rows sharing a context packed into one sequence each (see the module docstring).

    A row's context is its tokens up to and including the position that predicts its
    first trained token; rows with the same context share it. A group whose packed
    length would pass ``max_length`` (default: the longest row or
    :data:`MIN_PACK_LENGTH`) is split, each part with its own copy of the context.
    ``mask_dtype`` is ``torch.bool`` (True: may attend) or a float dtype (0 or its
    lowest value, added to the scores), as the model's attention expects.
    """
    input_ids, attention_mask = part.input(batch, torch.device("cpu"))
    rows, cols = trained_positions(part, batch)
    lengths = attention_mask.sum(1).tolist()
    tokens = input_ids.tolist()
    first: dict[int, int] = {}
    for row, col in zip(rows.tolist(), cols.tolist(), strict=True):
        first.setdefault(row, col)
    limit = max_length or max(MIN_PACK_LENGTH, part.width)

    # rows that share a context, in order of first appearance
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, length in enumerate(lengths):
        end = first.get(row, length - 1) + 1  # the context: tokens [0, end)
        groups.setdefault(tuple(tokens[row][:end]), []).append(row)

    packing = _Packing.of(groups, lengths, limit)
    source_rows, source_cols, segments = packing.rows, packing.cols, packing.segments
    count = len(source_cols)
    length = max(len(columns) for columns in source_cols)
    segment = torch.full((count, length), -1, dtype=torch.long)  # -1 padding
    positions = torch.zeros((count, length), dtype=torch.long)
    ids = torch.full((count, length), tokens[0][-1], dtype=torch.long)
    for sequence, columns in enumerate(source_cols):
        n = len(columns)
        segment[sequence, :n] = torch.tensor(segments[sequence])
        positions[sequence, :n] = torch.tensor(columns)
        ids[sequence, :n] = input_ids[torch.tensor(source_rows[sequence]), positions[sequence, :n]]
    # the flat position of the hidden state that predicts each trained token
    sequence_of = torch.tensor(packing.row_sequence)[rows]
    shared_of = torch.tensor(packing.row_shared)[rows]
    own = torch.tensor(packing.row_offset)[rows] + cols - shared_of  # in the row's own tokens
    source = sequence_of * length + torch.where(cols < shared_of, cols, own)
    return ModelInput(
        input_ids=ids.to(device),
        attention_mask=_segment_attention(segment, mask_dtype).to(device),
        position_ids=positions.to(device),
        source=source.to(device),
        rows=rows.to(device),
        cols=cols.to(device),
        targets=input_ids[rows, cols + 1].to(device),
        shape=(len(lengths), part.width - 1),
    )


@dataclass
class _Packing:
    """Each packed sequence as flat lists: where its tokens come from (``rows``, ``cols``:
    their positions in their own rows) and their segment (0: the context, k: the k-th
    row's own tokens); and per row, its sequence, where its own tokens start there, and
    the length of the context it shares."""

    rows: list[list[int]]
    cols: list[list[int]]
    segments: list[list[int]]
    row_sequence: list[int]
    row_offset: list[int]
    row_shared: list[int]

    @classmethod
    def of(
        cls, groups: dict[tuple[int, ...], list[int]], lengths: list[int], limit: int
    ) -> _Packing:
        """Pack each group's rows after its context, a new sequence (with its own copy of
        the context) whenever the next row would pass ``limit``."""
        n = len(lengths)
        packing = cls([], [], [], [0] * n, [0] * n, [0] * n)
        for context, members in groups.items():
            shared = len(context)
            sequence = None
            for row in members:
                tail = lengths[row] - shared
                if sequence is None or len(packing.cols[sequence]) + tail > limit:
                    sequence = len(packing.cols)
                    packing.rows.append([row] * shared)
                    packing.cols.append(list(range(shared)))
                    packing.segments.append([0] * shared)
                packing.row_sequence[row] = sequence
                packing.row_offset[row] = len(packing.cols[sequence])
                packing.row_shared[row] = shared
                packing.rows[sequence] += [row] * tail
                packing.cols[sequence] += range(shared, lengths[row])
                own_segment = packing.segments[sequence][-1] + 1  # a segment of its own
                packing.segments[sequence] += [own_segment] * tail
        return packing


def _segment_attention(segment: Tensor, mask_dtype: torch.dtype) -> Tensor:
    """[S, 1, L, L] who may see whom in packed sequences of ``segment`` [S, L] (-1:
    padding): causally, the context and the own segment; as booleans or, for a float
    ``mask_dtype``, 0 or its lowest value (added to the scores)."""
    length = segment.shape[1]
    query = torch.arange(length)
    causal = query[:, None] >= query[None, :]  # [L, L]
    sees = (segment[:, None, :] == 0) | (segment[:, :, None] == segment[:, None, :])
    allowed = causal & sees & (segment[:, None, :] >= 0)
    allowed |= torch.eye(length, dtype=torch.bool)  # padding sees itself: no empty row
    mask = allowed[:, None]  # [S, 1, L, L]
    if mask_dtype != torch.bool:
        lowest = torch.finfo(mask_dtype).min
        mask = torch.zeros(mask.shape, dtype=mask_dtype).masked_fill(~mask, lowest)
    return mask


def token_outputs(
    model: nn.Module,
    inputs: ModelInput,
    temperature: float,
    entropy: Literal["none", "metric", "loss"] = "metric",
) -> TokenOutputs:
    """Log-probs of the trained tokens, and their entropies and values, the LM head run
    only on the hidden states that predict them. Gradients flow where the caller's grad
    mode lets them; the entropy gets one only as a ``"loss"`` term (a ``"metric"`` is
    computed without)."""
    language = language_model(model)
    head = language.get_output_embeddings()
    softcap = getattr(language.config, "final_logit_softcapping", None)
    # chunks only where the logits would not fit in one; an adapted head (LoRA) runs whole
    chunked = CHUNKED_HEAD and type(head) is nn.Linear
    chunked = (
        chunked and inputs.targets.numel() * head.out_features > head_chunks.HEAD_CHUNK_ELEMENTS
    )
    flat_source = inputs.source
    computed: dict[str, tuple[Tensor, Tensor | None]] = {}

    def select(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        hidden = hidden.reshape(-1, hidden.shape[-1])[flat_source]
        if not chunked:
            return (hidden, *args[1:])
        # in the forward, where FSDP2 holds the head's weight gathered; the head itself
        # then runs on no rows, so the model's own logits are [0, V]
        computed["head"] = head_token_outputs(
            hidden, module.weight, module.bias, inputs.targets, temperature, softcap, entropy
        )
        return (hidden[:0], *args[1:])

    hook = head.register_forward_pre_hook(select)
    try:
        kwargs = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask}
        if inputs.position_ids is not None:
            kwargs["position_ids"] = inputs.position_ids
        if isinstance(model, PolicyWithValueHead):
            logits, values = model(**kwargs)
        else:
            logits, values = model(**kwargs).logits, None
    finally:
        hook.remove()
    if chunked:
        logprobs, out_entropy = computed["head"]
    else:
        logprobs, out_entropy = _whole_head_outputs(logits, inputs, temperature, entropy)
    if values is not None:
        values = values.reshape(-1)[flat_source].float()
    return TokenOutputs(
        logprobs=_scatter(logprobs, inputs),
        entropy=None if out_entropy is None else _scatter(out_entropy, inputs),
        values=None if values is None else _scatter(values, inputs),
    )


def _whole_head_outputs(
    logits: Tensor, inputs: ModelInput, temperature: float, entropy: str
) -> tuple[Tensor, Tensor | None]:
    """Log-probs and entropies from the head's ``[N, V]`` logits, all at once (a head that
    is not a plain linear layer: its forward is the only way to its logits)."""
    logits = logits.reshape(-1, logits.shape[-1])  # [N, V]
    logprobs = token_logprobs(logits[None], inputs.targets[None], temperature)[0]
    if entropy == "loss":
        return logprobs, entropy_from_logits(logits, temperature)
    if entropy == "metric":
        with torch.no_grad():
            return logprobs, entropy_from_logits(logits, temperature)
    return logprobs, None


def _scatter(values: Tensor, inputs: ModelInput) -> Tensor:
    """``values[i]`` at ``(rows[i], cols[i])`` of a zero ``[b, width - 1]`` tensor."""
    out = values.new_zeros(inputs.shape)
    return out.index_put((inputs.rows, inputs.cols), values)


# --------------------------------------------------------------------------- choosing


SELF_CHECK_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
"""Largest log-prob difference between the packed and the padded layout that counts as
float rounding (any other dtype: 3e-2); a model that ignores or misreads the 4-D mask
or the positions is off by far more."""


class Layout:
    """Lays out each micro-batch for the model: packed (:func:`packed_input`) where the
    model has shown it computes the same log-probs that way, padded otherwise.

    ``setting`` is ``learner.pack_sequences``: ``"auto"`` packs when the model passes a
    check at start (the same tokens through both layouts, every rank alike), ``True``
    raises when it does not, ``False`` never packs. Packing needs attention that takes a
    4-D mask (``sdpa`` or ``eager``); a sliding-window model packs only micro-batches
    no longer than its window (beyond it the window's own mask is needed).
    """

    def __init__(
        self, model: nn.Module, setting: str | bool, device: torch.device, world_size: int
    ):
        config = language_model(model).config
        implementation = getattr(config, "_attn_implementation", None)
        self.mask_dtype = torch.bool if implementation == "sdpa" else torch.float32
        self.window = _sliding_window(config)
        self.reason = ""
        """Why micro-batches are not packed ('' when they are)."""
        if setting is False:
            self.reason = "learner.pack_sequences=false"
        elif implementation not in ("sdpa", "eager"):
            self.reason = f"attention {implementation!r} takes no 4-D mask (sdpa or eager do)"
        else:
            difference = self._self_check(model, device, world_size)
            dtype = next(model.parameters()).dtype
            if not difference <= SELF_CHECK_TOLERANCE.get(dtype, 3e-2):
                self.reason = f"the model's log-probs packed differ from padded by {difference:.3g}"
        if self.reason and setting is True:
            raise ValueError(f"learner.pack_sequences=true, but {self.reason}")
        self.packed = not self.reason

    def input(self, part: MicroBatch, batch: TrainBatch, device: torch.device) -> ModelInput:
        if self.packed and (self.window is None or part.width <= self.window):
            return packed_input(part, batch, device, self.mask_dtype, self.window)
        return padded_input(part, batch, device)

    def _self_check(self, model: nn.Module, device: torch.device, world_size: int) -> float:
        """The largest log-prob difference, packed against padded, on a small batch whose
        rows share and do not share contexts (every rank runs it: FSDP's collectives)."""
        batch = _check_batch(language_model(model).config.vocab_size)
        part = MicroBatch(torch.arange(batch.num_samples), batch.input_ids.shape[1])
        with torch.no_grad():
            padded = token_outputs(model, padded_input(part, batch, device), 1.0, "none")
            packed = token_outputs(
                model, packed_input(part, batch, device, self.mask_dtype), 1.0, "none"
            )
        difference = (packed.logprobs - padded.logprobs).abs().max().double()
        if world_size > 1:
            torch.distributed.all_reduce(difference, op=torch.distributed.ReduceOp.MAX)
        return float(difference)


def _sliding_window(config) -> int | None:
    """The attention window of a model with sliding-window layers, else None."""
    window = getattr(config, "sliding_window", None)
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ()) or getattr(
        config, "use_sliding_window", False
    )
    return int(window) if window and sliding else None


def _check_batch(vocab_size: int) -> TrainBatch:
    """Three rows: two share a 6-token context and differ after it, the third has its own
    (shorter) one; the responses are of different lengths, so there is padding too."""
    generator = torch.Generator().manual_seed(0)
    high = min(vocab_size, 1000)
    shared = torch.randint(0, high, (6,), generator=generator)
    rows = [
        (shared, torch.randint(0, high, (5,), generator=generator)),
        (shared, torch.randint(0, high, (3,), generator=generator)),
        (
            torch.randint(0, high, (4,), generator=generator),
            torch.randint(0, high, (6,), generator=generator),
        ),
    ]
    width = max(len(p) + len(r) for p, r in rows)
    batch = TrainBatch.padding(len(rows), width, pad_id=0)
    for i, (prompt, response) in enumerate(rows):
        n = len(prompt) + len(response)
        batch.input_ids[i, :n] = torch.cat([prompt, response])
        batch.attention_mask[i, :n] = 1
        batch.loss_mask[i, len(prompt) - 1 : n - 1] = 1
    return batch
