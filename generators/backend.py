"""The generation backend contract, shared by every engine (see docs/generators.md).

A backend extends rollouts chunk by chunk with the weights it holds::

    backend.generate_chunk(rollouts, max_tokens)  # unfinished rollouts grow by <= max_tokens
    backend.load_weights(state_dict, version)     # between chunks: newer weights, in place
    backend.load_weights_in_parts(names, parts, version)  # optional: the same, streamed
    backend.abort(rollouts)                       # any thread: cut the running chunk short
    backend.close()

For every token it appends, a backend records the log-prob of that token under
the distribution it was sampled from (temperature, then top-k, then top-p
applied, renormalised) and the version of the weights that produced it. A
rollout's earlier tokens are never touched again: after ``load_weights`` the
next chunk continues the same sequences with the new weights, whose tokens
carry the new version (partial rollouts). Nothing computed with older weights
(a KV cache, a cached prefix) is reused after a load.

Two engines implement it: :class:`~asyncrl.generators.hf_backend.HFBackend`
(transformers ``generate``, the CPU default) and
:class:`~asyncrl.generators.vllm_backend.VLLMBackend` (vLLM's engine, an
optional extra). :func:`asyncrl.generators.engines.build_backend` picks one from
``generators.backend``; this module imports neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from asyncrl.core.messages import EpisodeCounts


@dataclass
class Rollout:
    """One sample in progress: a prompt and the response generated so far."""

    group_id: int
    sample_index: int
    prompt_ids: list[int]
    ground_truth: str
    data_source: str = ""
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """Per response token: 1 for the model's tokens, 0 for ones an environment added."""
    finish_reason: str | None = None
    """None while unfinished; ``"stop"`` (EOS or a stop string) or ``"length"`` (max_new_tokens)."""
    started_at: float = 0.0
    max_new_tokens: int | None = None
    """Response length at which this rollout ends with ``"length"``; None: the backend's
    ``max_new_tokens``. A multi-turn episode moves it on at every turn."""
    episode: EpisodeCounts | None = None
    """Set when a multi-turn episode that took a turn is over: what it did, sent with the
    sample so the buffer can report turns and tool use per batch. None: a single turn."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_limit(self, default: int) -> int:
        return default if self.max_new_tokens is None else self.max_new_tokens


@runtime_checkable
class Backend(Protocol):
    """What the generator replica needs from an engine."""

    version: int
    """Version of the weights loaded now; 0 for the initial weights."""
    tokenizer: object
    """The policy's tokenizer (for decoding responses and stop strings)."""
    last_load_s: float
    """Seconds the latest ``load_weights`` took (0.0 before the first)."""

    def generate_chunk(self, rollouts: list[Rollout], max_tokens: int) -> None:
        """Extend each unfinished rollout by at most ``max_tokens`` tokens, in place.

        Appends to ``response_ids``, ``logprobs`` and ``token_versions`` (one
        entry each per token) and sets ``finish_reason`` when a rollout ends:
        ``"stop"`` after EOS or the token that completes a stop string (nothing
        after it is kept), ``"length"`` at ``generators.max_new_tokens``.
        Finished rollouts are left as they are. A rollout that is still
        unfinished afterwards is resumed by passing it again: the engine
        re-reads prompt + response so far, with whatever weights it then holds.
        """
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace every parameter in place (the engine keeps running); later tokens get
        ``version``. A missing or extra tensor raises ValueError before anything changes.
        Invalidates every cache computed with the previous weights."""
        ...

    # Optional (the shared-memory path follows a write in progress when an engine has it):
    # def load_weights_in_parts(
    #     self, names: Sequence[str], parts: Iterable[Mapping[str, torch.Tensor]], version: int
    # ) -> None:
    #     """``load_weights`` with the tensors arriving in parts: ``names`` (every tensor to
    #     come) are checked first, ValueError before anything changes; each part is copied in
    #     as it arrives; ``version`` holds after the last. An exception from ``parts`` leaves
    #     a mix of two versions: the caller must load a whole one before generating."""
    #
    # Optional (the collective path then receives straight into the engine's tensors):
    # def weight_buffers(self, buckets: Sequence[Bucket]) -> list[torch.Tensor] | None:
    #     """One flat byte buffer per bucket that *is* the engine's tensors, laid out as the
    #     buckets say (the first call for a layout moves them there; None: it cannot be).
    #     Bytes written there change the weights at once: a broken transfer leaves a mix."""
    # def weights_written(self, version: int) -> None:
    #     """The buffers hold ``version`` now: later tokens get it, caches go."""

    def abort(self, rollouts: Iterable[Rollout]) -> None:
        """Stop generating ``rollouts`` in the chunk now in progress; safe from any thread.

        They keep every token made so far (with its version and log-prob), stay
        unfinished, and resume when passed to ``generate_chunk`` again. Rollouts
        not being generated at the moment are unaffected.
        """
        ...

    def close(self) -> None:
        """Release the engine (vLLM: shut its engine-core processes down)."""
        ...


def check_state_dict(
    expected: set[str], optional: set[str], state_dict: Mapping[str, object], version: int
) -> None:
    """Raise ValueError naming what is missing or extra, before any weight is touched."""
    missing = expected - optional - set(state_dict)
    extra = set(state_dict) - expected
    if missing or extra:
        problem = f"missing {sorted(missing)}, extra {sorted(extra)}"
        raise ValueError(f"weights v{version} do not fit the model: {problem}")


def load_module_in_parts(
    module: torch.nn.Module,
    optional: set[str],
    names: Iterable[str],
    parts: Iterable[Mapping[str, torch.Tensor]],
    version: int,
) -> None:
    """Copy ``parts`` into ``module``'s parameters: every name checked before the first part
    (:func:`check_state_dict`), each part then by :func:`copy_parameters`. The body of an
    in-process engine's ``load_weights_in_parts``."""
    import torch

    parameters = module.state_dict()  # detached views of the parameters
    check_state_dict(set(parameters), optional, dict.fromkeys(names), version)
    with torch.no_grad():
        for part in parts:
            copy_parameters(parameters, part, version)


def module_buffers(
    module: torch.nn.Module, buckets: Sequence, held: list[torch.Tensor] | None
) -> list[torch.Tensor] | None:
    """Flat byte buffers, one per bucket (``dtype``, ``nbytes``, ``tensors`` with ``name``,
    ``shape`` and byte ``offset``), that are ``module``'s own tensors, so that a bucket
    received into its buffer is loaded without a copy. ``held``: the buffers an earlier
    call returned, reused while the tensors still live there; otherwise the tensors are
    moved into new ones (one copy, once per layout). None when the layout cannot be the
    module's: a name it lacks, another dtype or shape, a tensor under two names.
    The body of an in-process engine's ``weight_buffers``."""
    import torch

    from asyncrl.weights.layout import FROM_NAME

    tensors = module.state_dict(keep_vars=True)  # the live tensors, by every name
    placed: list[tuple[int, int, torch.Tensor]] = []  # bucket, byte offset, live tensor
    seen: set[int] = set()
    for number, bucket in enumerate(buckets):
        dtype = FROM_NAME.get(bucket.dtype)
        for tensor in bucket.tensors:
            live = tensors.get(tensor.name)
            if live is None or live.dtype != dtype or tuple(live.shape) != tuple(tensor.shape):
                return None
            if live.data_ptr() in seen and live.numel():  # tied: one tensor, two names
                return None
            seen.add(live.data_ptr())
            placed.append((number, tensor.offset, live))
    sizes = [bucket.nbytes for bucket in buckets]
    if (
        held is not None
        and [flat.numel() for flat in held] == sizes
        and all(live.data_ptr() == held[n].data_ptr() + at for n, at, live in placed)
    ):
        return held
    flats = [torch.empty(size, dtype=torch.uint8) for size in sizes]
    with torch.no_grad():
        for number, at, live in placed:
            nbytes = live.numel() * live.element_size()
            home = flats[number][at : at + nbytes].view(live.dtype).view(live.shape)
            home.copy_(live)
            live.data = home
    return flats


def copy_parameters(
    parameters: Mapping[str, torch.Tensor], part: Mapping[str, torch.Tensor], version: int
) -> None:
    """Copy ``part`` into the engine's ``parameters`` (detached views of them) by name. A name
    or shape that is not the model's is a ValueError naming it, raised before any of the part
    is copied (``copy_`` would broadcast a wrong shape silently)."""
    for name, tensor in part.items():
        target = parameters.get(name)
        if target is None:
            raise ValueError(f"weights v{version}: '{name}' is not one of the model's tensors")
        if target.shape != tensor.shape:
            raise ValueError(
                f"weights v{version}: '{name}' has shape {tuple(tensor.shape)}, "
                f"the model's is {tuple(target.shape)}"
            )
    for name, tensor in part.items():
        parameters[name].copy_(tensor)


class StopStrings:
    """Finds the token that completes one of ``stop`` in a response's text.

    Only a window at the end of the response is decoded after each token (long
    enough for the longest stop string however the tokenizer splits it), so the
    check costs the same at token 10 and token 10,000. A stop string that spans
    chunks is found like any other. Special tokens are decoded too: a turn marker
    that is one (Llama-3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``) must end the
    turn even when it is not the tokenizer's EOS.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        # a token decodes to at least part of one character; 4 tokens cover a UTF-8 char
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 4

    def __bool__(self) -> bool:
        return bool(self.stop)

    def completed_by_last_token(self, response_ids: list[int]) -> bool:
        if not self.stop:
            return False
        tail = response_ids[-self.window :]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        if not any(s in text for s in self.stop):
            return False
        # Did the last token add an occurrence? Counting (not just testing) matters when
        # earlier text in the window already holds one: an environment's reply in a
        # multi-turn episode ends with the turn marker the model is asked to stop at.
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
        return any(text.count(s) > before.count(s) for s in self.stop)


def append_tokens(
    rollout: Rollout,
    tokens: Iterable[int],
    logprobs: Iterable[float],
    version: int,
    *,
    eos_token_id: int | None,
    max_new_tokens: int,
    stop: StopStrings,
) -> None:
    """Append sampled tokens to ``rollout`` until one ends it; the rest are dropped.

    The ending rules of every backend, so both engines finish a sequence at the
    same token: EOS -> "stop"; the token completing a stop string -> "stop";
    reaching the rollout's token limit (``max_new_tokens`` unless the rollout
    sets its own) -> "length".
    """
    limit = rollout.token_limit(max_new_tokens)
    for token, logprob in zip(tokens, logprobs, strict=True):
        rollout.response_ids.append(int(token))
        rollout.logprobs.append(float(logprob))
        rollout.token_versions.append(version)
        rollout.loss_mask.append(1)
        if token == eos_token_id or stop.completed_by_last_token(rollout.response_ids):
            rollout.finish_reason = "stop"
            return
        if len(rollout.response_ids) >= limit:
            rollout.finish_reason = "length"
            return
