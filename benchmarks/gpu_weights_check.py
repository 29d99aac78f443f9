"""The GPU check's weight publishing (``gpu_check.py`` runs it in a process of its own):
a Qwen2-shaped policy's weights, from the learner's GPU tensors to a generator replica's
model on the same GPU, by each path that runs on one GPU, against a device-to-host copy of
the same bytes.

- ``d2h``: the tensors copied into warm host buffers, pinned and pageable: the limit of
  the shm path's first half (on a CPU rehearsal, a memory copy);
- ``shm``: :class:`~asyncrl.weights.shm.publisher.ShmPublisher` fed the GPU tensors
  themselves (its write into the segment is the copy to the host), a replica process
  following the write with :class:`~asyncrl.weights.shm.reader.ShmSource` into a module
  of the policy's names and shapes on the GPU, loaded as the HF backend loads;
- ``cuda_ipc``: the learner hands the replica IPC handles of its tensors
  (:mod:`asyncrl.weights.cuda_ipc`); the replica maps them and copies them device to
  device into its module. CUDA only.

As in ``weights_publish.py``, the replica is already waiting for the version when the
publish starts; publish to loaded runs from the learner's call to the replica's module
holding the version (after a CUDA synchronize); the loaded bytes are checked against the
learner's (crc32) on the first publishes by each path, which are not timed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import shutil
import statistics
import time
import traceback
from pathlib import Path

import torch
import weights_paths
from gpu_check import NO_CUDA, Figures
from gpu_model_checks import qwen2_model, synchronize

from asyncrl.weights import DEFAULT_CHUNK_BYTES

WARMUPS = 2
"""Untimed publishes by each path: the first (the shm segment is made), one following."""
DEADLINE_S = 30.0
"""A replica gives up a version after this long; the learner waits a little longer."""
GB = 1e9


def weights_publish(figures: Figures, device: str, shape: str, repeats: int) -> None:
    """Publish to loaded by shm and CUDA IPC against a device-to-host copy (module docstring)."""
    from asyncrl.generation.models import tied_names

    model = qwen2_model(shape, device, torch.float32)  # the learner's fp32 weights
    tied = tied_names(model)
    params = {
        name: tensor.detach()
        for name, tensor in model.state_dict().items()
        if tied is None or name != tied[1]  # a tied head is published once, as the embedding
    }
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    figures["model"] = {"shape": shape, "dtype": "float32", "tensors": len(params),
                        "bytes": nbytes}  # fmt: skip
    figures["d2h"] = host_copies(params, device, repeats)
    baseline_s = figures["d2h"].get("pinned_s", figures["d2h"]["pageable_s"])
    expect = weights_paths.stream_crc(t.cpu() for t in params.values())
    shapes = [(name, tuple(t.shape), t.dtype) for name, t in params.items()]
    paths = {"shm": shm_path, "cuda_ipc": ipc_path if device == "cuda" else None}
    failed = []
    with Replica(device) as replica:
        replica.ask(("model", shapes))
        for path, measure in paths.items():  # one failing path leaves the other's figures
            if measure is None:
                figures[path] = {"skipped": NO_CUDA}
                continue
            try:
                figures[path] = ratios(measure(params, replica, repeats, expect), nbytes,
                                       baseline_s)  # fmt: skip
            except Exception as error:
                traceback.print_exc()
                figures[path] = {"error": f"{type(error).__name__}: {error}"}
                failed.append(path)
    if failed:
        raise AssertionError(f"weights by {failed} failed (their 'error' says how)")


def host_copies(params: dict[str, torch.Tensor], device: str, repeats: int) -> dict:
    """Median seconds to copy ``params`` into warm host buffers, pinned (CUDA) and pageable."""
    out = {}
    for pinned in (True, False) if device == "cuda" else (False,):
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in params.values()]
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            synchronize(device)
            started = time.perf_counter()
            for buffer, tensor in zip(buffers, params.values(), strict=True):
                buffer.copy_(tensor, non_blocking=pinned)
            synchronize(device)
            times.append(time.perf_counter() - started)
        kind = "pinned" if pinned else "pageable"
        out[f"{kind}_s"] = statistics.median(times[1:])
        out[f"{kind}_gbps"] = sum(b.numel() * b.element_size() for b in buffers) / out[
            f"{kind}_s"
        ] / GB  # fmt: skip
        del buffers
    return out


def ratios(runs: dict, nbytes: int, baseline_s: float) -> dict:
    """``runs`` with the median publish to loaded as GB/s and as a share of the baseline."""
    loaded = statistics.median(r["loaded_s"] for r in runs["runs"])
    return runs | {"loaded_s": loaded, "loaded_gbps": nbytes / loaded / GB,
                   "of_d2h": baseline_s / loaded}  # fmt: skip


def shm_path(params: dict[str, torch.Tensor], replica: Replica, repeats: int, expect: int):
    sink = weights_paths.Sink("shm", bucket_bytes=64 << 20, chunk_bytes=DEFAULT_CHUNK_BYTES)
    runs = []
    try:
        replica.ask(("open", sink.where))
        for index in range(WARMUPS + repeats):
            replica.send(("sync", index + 1, DEADLINE_S))  # waiting, as between batches
            time.sleep(weights_paths.WAITING_S)
            began = time.monotonic()
            stall = sink.publish(params, index + 1)
            if not sink.sink.writer.ready:  # /dev/shm could not hold it: the log says why
                raise RuntimeError(f"no shared-memory segment for {shm_room()}")
            _, loaded_at = replica.receive()
            if index < WARMUPS:
                replica.verify(expect, "shm")
                continue
            runs.append({"stall_s": stall, "loaded_s": loaded_at - began})
        stats = {k: v for k, v in sink.stats().items() if k.startswith("weights_shm")}
    finally:
        with contextlib.suppress(Exception):
            replica.ask(("close",))
        sink.close()
    return {"runs": runs, "verified": True, "sink_stats": stats}


def shm_room() -> str:
    usage = shutil.disk_usage("/dev/shm")
    return f"the version: /dev/shm has {usage.free / GB:.1f} of {usage.total / GB:.1f} GB free"


def ipc_path(params: dict[str, torch.Tensor], replica: Replica, repeats: int, expect: int):
    from asyncrl.weights.cuda_ipc import export_handles

    runs = []
    for index in range(WARMUPS + repeats):
        began = time.monotonic()
        handles = export_handles(params)
        replica.send(("ipc", handles))
        _, loaded_at = replica.receive()
        if index < WARMUPS:
            replica.verify(expect, "cuda_ipc")
            continue
        runs.append({"loaded_s": loaded_at - began, "handle_bytes": len(handles)})
    return {"runs": runs, "verified": True}


# ------------------------------------------------------------------ the replica


class Replica:
    """A spawned process holding a module of the policy's shapes on ``device``."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self) -> Replica:
        spawn = mp.get_context("spawn")
        self.conn, theirs = spawn.Pipe()
        self.process = spawn.Process(target=replica_main, args=(theirs, self.device), daemon=True)
        self.process.start()
        assert self.receive() == "ready"
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=20)
        if self.process.is_alive():  # ours: ended by its own handle
            self.process.kill()

    def send(self, command: tuple) -> None:
        self.conn.send(command)

    def receive(self, timeout_s: float = DEADLINE_S + 10):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the replica did not answer in {timeout_s:.0f} s")
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"replica: {reply[1]}")
        return reply

    def ask(self, command: tuple):
        self.send(command)
        return self.receive()

    def verify(self, expect: int, path: str) -> None:
        if self.ask(("crc",)) != expect:
            raise AssertionError(f"{path}: the replica loaded other bytes than the learner's")


def replica_main(conn, device: str) -> None:
    """Answers ``model``, ``open``, ``sync``, ``ipc``, ``crc`` and ``close`` until None."""
    torch.set_num_threads(1)
    backend = source = None
    conn.send("ready")
    while (command := conn.recv()) is not None:
        kind, *args = command
        try:
            if kind == "model":
                module = weights_paths.module_of(args[0]).to(device)
                backend = weights_paths.ModuleBackend(module)
                reply = "ok"
            elif kind == "open":
                from asyncrl.weights.shm.reader import ShmSource

                source, reply = ShmSource(Path(args[0])), "ok"
            elif kind == "close":
                if source is not None:
                    source.close()
                source, reply = None, "ok"
            elif kind == "sync":
                started = weights_paths.sync_until(source, backend, *args)[0]
                synchronize(device)
                reply = (started, time.monotonic())
            elif kind == "ipc":
                reply = load_by_ipc(backend, args[0], device)
            elif kind == "crc":
                state = backend.model.state_dict().values()
                reply = weights_paths.stream_crc(t.detach().cpu() for t in state)
            else:
                raise ValueError(f"unknown command {kind}")
        except Exception as error:  # the learner raises it with the replica's words
            reply = ("error", f"{type(error).__name__}: {error}")
        conn.send(reply)


def load_by_ipc(backend: weights_paths.ModuleBackend, handles: bytes, device: str) -> tuple:
    """Map the learner's tensors and copy them into the module; (start, loaded) times."""
    from asyncrl.weights.cuda_ipc import import_handles

    started = time.monotonic()
    tensors = import_handles(handles)
    backend.load_weights(tensors, backend.version + 1)
    synchronize(device)
    del tensors  # unmapped before the learner may change them
    return started, time.monotonic()
