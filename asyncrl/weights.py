"""Versioned weights from the learner to the generators over ZeroMQ.

The learner calls :meth:`WeightPublisher.publish` after an update: it copies
the full tensors once (the only time the learner stalls) and swaps them in as
the latest version. A server thread answers each generator's
``WeightsRequest(have_version)`` with ``WeightsUpToDate`` or the latest
``Weights``: one frame per tensor, named in the header's tensor index, so the
receiver rebuilds the state dict and checks it got every tensor. Serving runs
beside the next training step, so publishing overlaps with training.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections import Counter

import torch
import zmq

from asyncrl.messages import (
    ArraySpec,
    ErrorReply,
    Weights,
    WeightsRequest,
    WeightsUpToDate,
    WireError,
    decode,
    encode,
    encode_raw,
)
from asyncrl.transport import RequestClient

log = logging.getLogger("asyncrl.weights")

TORCH_DTYPES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
FROM_NAME = {name: dtype for dtype, name in TORCH_DTYPES.items()}


class WeightPublisher:
    """Holds the latest published weights and serves them from a background thread."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.version = -1
        self._snapshot: tuple[int, float, list[ArraySpec], list[torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.served: Counter[str] = Counter()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._thread = threading.Thread(target=self._serve_loop, name="weights-server", daemon=True)
        self._thread.start()

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Snapshot ``state_dict`` as ``version``; returns the seconds the caller was stalled."""
        start = time.perf_counter()
        tensors = [t.detach().to("cpu", copy=True).contiguous() for t in state_dict.values()]
        specs = [
            ArraySpec(name, TORCH_DTYPES[t.dtype], tuple(t.shape))
            for name, t in zip(state_dict, tensors, strict=True)
        ]
        with self._lock:
            self._snapshot = (version, time.time(), specs, tensors)
            self.version = version
        return time.perf_counter() - start

    def _serve_loop(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(100):
                continue
            identity, *frames = self._socket.recv_multipart(copy=False)
            try:
                body, _ = decode(frames)
                if not isinstance(body, WeightsRequest):
                    raise WireError("unexpected_type", f"weights server got {type(body).__name__}")
            except WireError as error:
                self.served[f"rejected_{error.reason}"] += 1
                self._socket.send_multipart(
                    [identity, *encode(ErrorReply(error.reason, str(error)))]
                )
                continue
            with self._lock:
                snapshot = self._snapshot
            if snapshot is None or snapshot[0] <= body.have_version:
                latest = -1 if snapshot is None else snapshot[0]
                self._socket.send_multipart([identity, *encode(WeightsUpToDate(latest))])
                continue
            version, published_at, specs, tensors = snapshot
            frames = [
                memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
                for t in tensors
            ]
            self._socket.send_multipart(
                [identity, *encode_raw(Weights(version, published_at), specs, frames)], copy=False
            )
            self.served["weights_sent"] += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
        self._context.term()


class WeightClient:
    """A generator's view of the publisher: fetch weights newer than the ones held."""

    def __init__(self, context: zmq.Context, endpoint: str, timeout_s: float = 120.0):
        self.client = RequestClient(context, endpoint, timeout_s)

    def fetch_newer(self, have_version: int) -> tuple[int, float, dict[str, torch.Tensor]] | None:
        """``(version, published_at, state_dict)`` if newer weights exist, else None."""
        body, arrays = self.client.request(WeightsRequest(have_version))
        if isinstance(body, WeightsUpToDate):
            return None
        if not isinstance(body, Weights):
            raise WireError("unexpected_type", f"expected weights, got {type(body).__name__}")
        state_dict = {}
        for name, frame in arrays.items():
            dtype = FROM_NAME[frame.spec.dtype]
            if frame.buffer.nbytes == 0:
                state_dict[name] = torch.empty(frame.spec.shape, dtype=dtype)
            else:
                with warnings.catch_warnings():  # read-only frame: load_state_dict copies it
                    warnings.simplefilter("ignore", UserWarning)
                    tensor = torch.frombuffer(frame.buffer, dtype=dtype)
                state_dict[name] = tensor.reshape(frame.spec.shape)
        return body.version, body.published_at, state_dict

    def close(self) -> None:
        self.client.close()
