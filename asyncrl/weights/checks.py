"""What a replica checks of a version before its engine serves it: the layout, and that
every value is finite.

Each path hands the engine bytes someone else wrote: the learner's snapshot over
ZeroMQ, its broadcast, or the shared-memory slot, which any process of the run's
user can open and write. A replica loads a version only when

- its layout is the engine's (:func:`check_layout`): the same tensor names (a tied
  LM head may be left out), each with the engine's shape and dtype. The engine's
  layout is the learner's: both build the model from one config. The byte sizes
  and offsets are checked by each path against its own index first
  (``shm.check_index``, ``WeightsManifest``, ``check_offer``);
- no floating-point value is NaN or infinite (:func:`check_finite`): one read
  of each byte, about half the time of copying the version into the engine.

A version that fails raises :class:`WeightsRefused`. Each path checks before the
engine's weights change where it holds the bytes apart from the engine (ZeroMQ's
fetched buffers, the broadcast's staging, the slot); where the bytes land in the
engine itself (the broadcast into an HF model's tensors, a vLLM worker's buckets,
a write followed part by part) it checks each part as it arrives and says
``partial``, and the chain reloads a whole version. Each path remembers what it
refused (:class:`Refusals`) so that one bad version is checked, counted and logged
once, not at every chunk.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import NamedTuple, Protocol

import torch

from asyncrl.core.connection_guard import RateLimitedLog
from asyncrl.weights.collective.buckets import Spec
from asyncrl.weights.layout import TORCH_DTYPES
from asyncrl.weights.source import WeightTransferError

log = logging.getLogger("asyncrl.weights")

NONFINITE = "nonfinite"
LAYOUT = "layout"
REFUSAL_LOG_INTERVAL_S = 60.0
"""At most one log line per path and reason per interval, with the count since."""


class WeightsRefused(WeightTransferError):
    """A version arrived and failed the replica's checks (``reason``: ``nonfinite`` or
    ``layout``). Without ``partial`` the engine still holds the version it had."""

    def __init__(self, message: str, *, reason: str, partial: bool = False):
        super().__init__(message, partial=partial)
        self.reason = reason


class Layout(NamedTuple):
    """The tensors an engine takes: by name, its shape and dtype (None where it cannot say),
    and the names it may go without (a tied LM head)."""

    specs: Mapping[str, Spec]
    optional: frozenset[str]


class _Entry(Protocol):
    name: str
    dtype: str
    shape: tuple[int, ...]


def engine_layout(backend) -> Layout | None:
    """What ``backend`` takes: the state dict of what an in-process engine loads into
    (``loads_into``: the model, or its LoRA adapters alone), else the engine's
    ``parameter_specs`` (vLLM) or its ``parameter_names``; None when it says nothing."""
    loads_into = getattr(backend, "loads_into", None)
    model = getattr(backend, "model", None)
    if loads_into is not None and loads_into is not model:  # LoRA adapters: nothing tied
        specs = {
            name: Spec(tuple(t.shape), TORCH_DTYPES.get(t.dtype))
            for name, t in loads_into.state_dict().items()
        }
        return Layout(specs, frozenset())
    if isinstance(model, torch.nn.Module):
        specs = {
            name: Spec(tuple(t.shape), TORCH_DTYPES.get(t.dtype))
            for name, t in model.state_dict().items()
        }
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        return Layout(specs, frozenset({"lm_head.weight"} if tied else ()))
    tied = getattr(backend, "tied", None)
    optional = frozenset({tied[1]} if tied else ())
    specs = getattr(backend, "parameter_specs", None)
    if specs is not None:
        return Layout(specs, optional)
    names = getattr(backend, "parameter_names", None)
    if names is None:
        return None
    return Layout({name: Spec(None, None) for name in names}, optional)


class EngineLayout:
    """``engine_layout`` of the engine a path loads into, read once: an engine's tensors keep
    their names, shapes and dtypes for its lifetime, and a path asks at every sync."""

    def __init__(self) -> None:
        self._engine: object | None = None
        self._layout: Layout | None = None

    def of(self, backend) -> Layout | None:
        if backend is not self._engine:
            self._engine, self._layout = backend, engine_layout(backend)
        return self._layout


def check_layout(layout: Layout | None, entries: Iterable[_Entry], version: int, path: str) -> None:
    """Raise :class:`WeightsRefused` naming the first tensor of ``entries`` (name, dtype,
    shape) the engine does not take as it is, or the engine's tensors it lacks."""
    if layout is None:
        return
    seen = set()
    for entry in entries:
        where = f"{path} v{version}: refused: tensor '{entry.name[:80]}'"
        spec = layout.specs.get(entry.name)
        if spec is None:
            raise WeightsRefused(f"{where} is not one of the engine's", reason=LAYOUT)
        if spec.shape is not None and tuple(entry.shape) != tuple(spec.shape):
            raise WeightsRefused(
                f"{where} has shape {tuple(entry.shape)}, the engine's is {tuple(spec.shape)}",
                reason=LAYOUT,
            )
        if spec.dtype is not None and entry.dtype != spec.dtype:
            raise WeightsRefused(
                f"{where} is {entry.dtype}, the engine's is {spec.dtype}", reason=LAYOUT
            )
        seen.add(entry.name)
    missing = set(layout.specs) - layout.optional - seen
    if missing:
        raise WeightsRefused(
            f"{path} v{version}: refused: missing {sorted(missing)[:8]}", reason=LAYOUT
        )


def nonfinite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """A description of the first tensor holding a NaN or an infinity, None when every
    floating-point value is finite.

    One sum per tensor reads each byte once and allocates nothing: a NaN or an
    infinity anywhere makes the sum NaN or infinite (one sync for all tensors). A
    non-finite sum of finite values (an overflow) is told apart by the tensor's
    minimum and maximum, which are NaN or infinite exactly when a value is.
    """
    named = [(name, t) for name, t in tensors if t.is_floating_point() and t.numel()]
    if not named:
        return None
    sums = torch.stack([t.sum() for _, t in named]).float()  # [N]
    if bool(torch.isfinite(sums).all()):
        return None
    found: list[tuple[str, str]] = []
    for index in (~torch.isfinite(sums)).nonzero().flatten().tolist():
        name, tensor = named[index]
        low, high = (float(end) for end in torch.aminmax(tensor))
        if not (math.isfinite(low) and math.isfinite(high)):
            found.append((name, "NaN" if math.isnan(low) or math.isnan(high) else "an infinity"))
    if not found:
        return None
    (name, what), others = found[0], len(found) - 1
    more = f" (and {others} more tensors)" if others else ""
    return f"tensor '{name[:80]}' holds {what}{more}"


def check_finite(
    tensors: Iterable[tuple[str, torch.Tensor]], version: int, path: str, partial: bool = False
) -> None:
    """Raise :class:`WeightsRefused` when a value of ``tensors`` is NaN or infinite."""
    problem = nonfinite(tensors)
    if problem is not None:
        raise WeightsRefused(
            f"{path} v{version}: refused: {problem}", reason=NONFINITE, partial=partial
        )


class Refusals:
    """One path's refusals: counted (``refused_<reason>`` in the path's ``counters``, the
    chain's ``weights_<path>_refused_<reason>``), logged at most once a minute per reason,
    and remembered by what identifies the refused bytes (a slot's write, a version's
    publish), so the same bytes are not checked, counted or logged again."""

    def __init__(self, counters: Counter[str]):
        self.counters = counters
        self.refused: set[object] = set()
        self._log = RateLimitedLog(REFUSAL_LOG_INTERVAL_S)

    def __contains__(self, identity: object) -> bool:
        return identity in self.refused

    def note(self, identity: object, error: WeightsRefused) -> None:
        """Count and log ``error``, and remember ``identity`` as refused."""
        if len(self.refused) >= 64:  # a long run refusing version after version
            self.refused.clear()
        self.refused.add(identity)
        self.counters[f"refused_{error.reason}"] += 1
        count = self._log.due(error.reason)
        if count:
            log.warning("%s; the weights held stay%s", error, since(count))


def since(count: int) -> str:
    """How many a rate-limited line stands for, when more than itself."""
    return f" ({count} such since the last line)" if count > 1 else ""
