"""The three weight-sync paths end to end, for ``weights_publish.py``: sinks, replicas, timing.

A measured publish is what a run does: learner rank 0 calls ``publish`` on the
path's sink (built as :func:`asyncrl.weights.paths.learner_sink` builds it),
while each replica, already waiting for it as a replica between batches does,
runs its path's ``WeightSource.sync_into`` into a stand-in of the HF backend
(a module with the policy's tensor names and shapes, loaded as the HF backend
loads, in parts where the path streams) until it holds the new version. The
shm reader thus follows the learner's write. Replicas are spawned
processes on the same host (or, given a network namespace, on another test
host: ``weights_over_link.py``); every clock is ``time.monotonic`` (one clock for
all processes on Linux), so "publish to loaded" is the last replica's end
minus the learner's publish start.

- ``zmq``: :class:`WeightPublisher` -> :class:`ZmqSource` over loopback TCP;
- ``shm``: :class:`ShmPublisher` (segment + ZeroMQ fed from it) -> :class:`ShmSource`;
- ``collective``: the shm sink with a :class:`CollectiveSender` beside it (it
  broadcasts the ZeroMQ snapshot, which the shm sink fills from a thread after
  the publish) -> :class:`CollectiveSource`, one pairwise gloo group per replica.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import secrets
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncrl.weights.source import PathUnavailable

if TYPE_CHECKING:
    from asyncrl.config import ClusterConfig

PATHS = ("zmq", "shm", "collective")
GB = 1e9
POLL_S = 0.001
"""A replica asks again this often while its path has nothing newer yet."""
WAITING_S = 0.05
"""How long replicas poll before the publish: they are waiting for it when it starts."""


CLONE_NEWNET = 0x40000000


def enter_netns(netns: str | None) -> None:
    """Move this process's calling thread into network namespace ``netns`` (an ``ip netns``
    name, e.g. a test host's of :mod:`asyncrl.testbed`) before it opens any socket or starts
    threads that will; None: stay where it is."""
    if netns is None:
        return
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    descriptor = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(descriptor, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
    finally:
        os.close(descriptor)


def trim_memory() -> None:
    """Hand freed heap memory back to the OS, so idle replicas do not hold a model."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def stream_crc(tensors) -> int:
    """crc32 of the tensors' bytes end to end: what a replica loaded against what was sent."""
    crc = 0
    for tensor in tensors:
        if tensor.numel():
            crc = zlib.crc32(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), crc)
    return crc


# --------------------------------------------------------------------------
# the replica: a module of the policy's shapes behind the HF backend's contract


def module_of(shapes: list[tuple[str, tuple[int, ...], torch.dtype]]) -> torch.nn.Module:
    """A module whose state dict has exactly these names, shapes and dtypes."""
    root = torch.nn.Module()
    for name, shape, dtype in shapes:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        tensor = torch.empty(shape, dtype=dtype)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


class ModuleBackend:
    """What the paths need of ``HFBackend``: ``model``, ``version``, ``load_weights``,
    ``load_weights_in_parts``, ``weight_buffers`` and ``weights_written`` (the copy into the
    parameters, and their buffers, are the HF backend's own: ``load_module_in_parts``,
    ``module_buffers``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.version = -1
        self.load_s = 0.0
        """Seconds spent loading so far (the copy into the module; following a write, also
        the waits for the learner's next tensor)."""

    def load_weights(self, state_dict, version: int) -> None:
        self.load_weights_in_parts(list(state_dict), [state_dict], version)

    def load_weights_in_parts(self, names, parts, version: int) -> None:
        from asyncrl.generators.backend import load_module_in_parts

        started = time.monotonic()
        load_module_in_parts(self.model, set(), names, parts, version)
        self.version = version
        self.load_s += time.monotonic() - started

    def weight_buffers(self, buckets):
        from asyncrl.generators.backend import module_buffers

        self._homes = module_buffers(self.model, buckets, getattr(self, "_homes", None))
        return self._homes

    def weights_written(self, version: int) -> None:
        self.version = version


def open_source(path: str, where, name: str, context):
    """The replica's source of ``path``; ``where`` is what the learner's sink told it."""
    if path == "zmq":
        from asyncrl.weights import WeightClient
        from asyncrl.weights.zmq.source import ZmqSource

        return ZmqSource(WeightClient(context, where, timeout_s=600.0))
    if path == "shm":
        from asyncrl.weights.shm.reader import ShmSource

        return ShmSource(Path(where))
    from asyncrl.weights.collective.groups import GroupAddress
    from asyncrl.weights.collective.receiver import CollectiveSource

    address, key, bucket_bytes = where
    return CollectiveSource(GroupAddress(*address), key, name, bucket_bytes=bucket_bytes)


def replica_main(conn, name: str, netns: str | None = None) -> None:
    """Answers the learner's commands: ``model``, ``open``, ``sync``, ``crc``, ``close``;
    in network namespace ``netns`` when given (a replica on another test host).

    ``open`` may carry the run's ``ClusterConfig`` after the path's address: the replica
    then connects as a generator with the run's credentials (CURVE beyond loopback)."""
    import zmq

    enter_netns(netns)
    torch.set_num_threads(1)
    context = zmq.Context()
    secured: zmq.Context | None = None
    backend: ModuleBackend | None = None
    source = None
    conn.send("ready")
    while (command := _next(conn)) is not None:
        kind, *args = command
        try:
            if kind == "model":
                backend = None
                trim_memory()
                backend = ModuleBackend(module_of(args[0]))
                reply = "ok"
            elif kind == "open":
                path, where, *cluster = args
                if cluster and cluster[0] is not None:
                    from asyncrl.core.security import GENERATOR, client_context

                    secured = client_context(cluster[0], GENERATOR)
                source = open_source(path, where, name, secured or context)
                reply = "ok"
            elif kind == "close":
                if source is not None:
                    source.close()
                source = None
                if secured is not None:
                    secured.destroy(linger=0)
                secured = None
                trim_memory()
                reply = "ok"
            elif kind == "sync":
                reply = sync_until(source, backend, *args)
            elif kind == "crc":
                reply = stream_crc(t.detach() for t in backend.model.state_dict().values())
            else:
                raise ValueError(f"unknown command {kind}")
        except Exception as error:  # the learner raises it with the replica's words
            reply = ("error", f"{name}: {type(error).__name__}: {error}")
        conn.send(reply)
    if source is not None:
        source.close()
    if secured is not None:
        secured.destroy(linger=0)
    context.destroy(linger=0)


def _next(conn):
    """The next command; None also when the learner went away."""
    try:
        return conn.recv()
    except EOFError:
        return None


def sync_until(source, backend: ModuleBackend, version: int, deadline_s: float) -> tuple:
    """Sync until ``backend`` holds ``version``: (start, end, seconds in ``load_weights``,
    tries, start of the try that loaded it)."""
    started = time.monotonic()
    tries = 0
    loading_before = backend.load_s
    while backend.version < version:
        if time.monotonic() - started > deadline_s:
            raise TimeoutError(f"v{version} not loaded in {deadline_s}s")
        tries += 1
        begun = time.monotonic()
        try:
            loaded = source.sync_into(backend, backend.version, begun + deadline_s)
        except PathUnavailable:  # no segment before the first publish: ask again
            loaded = None
        if loaded is None:
            time.sleep(POLL_S)  # the path has nothing newer yet
    return started, time.monotonic(), backend.load_s - loading_before, tries, begun


class Replicas:
    """``count`` replica processes, driven over pipes; in network namespace ``netns`` when
    given (:func:`enter_netns`)."""

    def __init__(self, count: int, netns: str | None = None):
        spawn = mp.get_context("spawn")
        self.conns, self.processes = [], []
        for index in range(count):
            ours, theirs = spawn.Pipe()
            process = spawn.Process(
                target=replica_main, args=(theirs, f"replica-{index}", netns), daemon=True
            )
            process.start()
            self.conns.append(ours)
            self.processes.append(process)
        for conn in self.conns:
            assert conn.recv() == "ready"

    def send(self, count: int, command: tuple) -> None:
        for conn in self.conns[:count]:
            conn.send(command)

    def gather(self, count: int) -> list:
        replies = [conn.recv() for conn in self.conns[:count]]
        for reply in replies:
            if isinstance(reply, tuple) and reply and reply[0] == "error":
                raise RuntimeError(reply[1])
        return replies

    def ask(self, count: int, command: tuple) -> list:
        self.send(count, command)
        return self.gather(count)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                conn.send(None)
        for process in self.processes:
            process.join(timeout=20)
            if process.is_alive():  # ours: ended by its own handle, never by name
                process.kill()


# --------------------------------------------------------------------------
# the learner's sinks


class Sink:
    """One path's learner side: ``publish``, what replicas need to reach it, ``close``.

    Listens on ``host``; ``cluster``: the run's, whose credentials the ZeroMQ publisher
    admits (None: any peer, as on a trusted machine)."""

    def __init__(
        self,
        path: str,
        bucket_bytes: int,
        chunk_bytes: int,
        host: str = "127.0.0.1",
        cluster: ClusterConfig | None = None,
    ):
        from asyncrl.core.transport import free_port, tcp
        from asyncrl.weights import WeightPublisher
        from asyncrl.weights.shm.publisher import ShmPublisher
        from asyncrl.weights.shm.writer import ShmWriter

        self.path = path
        self.run_dir = Path(tempfile.mkdtemp(prefix="asyncrl-bench-"))  # 0700
        self.zmq = WeightPublisher(
            tcp(host, free_port(host)), chunk_bytes=chunk_bytes, cluster=cluster
        )
        self.sink = self.zmq
        self.where: object = self.zmq.endpoint
        if path in ("shm", "collective"):
            self.sink = ShmPublisher(self.zmq, ShmWriter(self.run_dir))
            self.where = str(self.run_dir)
        if path == "collective":
            from asyncrl.core.signing import group_key_pair
            from asyncrl.weights.collective.sender import CollectiveSender, WithBroadcast

            learner_key, replica_key = group_key_pair(
                secrets.token_bytes(32), secrets.token_bytes(32)
            )
            sender = CollectiveSender(
                self.zmq.snapshots,
                host,
                0,
                learner_key,
                bucket_bytes=bucket_bytes,
                deadline_s=600.0,
                run_dir=self.run_dir,
            )
            self.sink = WithBroadcast(self.sink, sender)
            self.where = (tuple(sender.address), replica_key, bucket_bytes)

    def publish(self, params: dict[str, torch.Tensor], version: int) -> float:
        return self.sink.publish(iter(params.items()), version)

    def stats(self) -> dict[str, float]:
        return self.sink.stats()

    def close(self) -> None:
        self.sink.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


# --------------------------------------------------------------------------
# one path, one model, 1 and N replicas


def measure_path(
    path: str,
    params: dict[str, torch.Tensor],
    replicas: Replicas,
    counts: list[int],
    *,
    repeats: int,
    warmups: int,
    version: int,
    bucket_bytes: int,
    chunk_bytes: int,
    host: str = "127.0.0.1",
    cluster: ClusterConfig | None = None,
) -> tuple[dict, int]:
    """Publish-to-loaded and stalls of ``path`` for each replica count in ``counts``; the
    learner's side listens on ``host``, with ``cluster``'s credentials when given."""
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    expect = stream_crc(params.values())
    sink = Sink(path, bucket_bytes, chunk_bytes, host, cluster)
    result: dict = {"stalls_cold_s": []}
    most = max(counts)
    try:
        secured = () if cluster is None else (cluster,)
        replicas.ask(most, ("open", path, sink.where, *secured))
        for count in counts:
            runs = []
            for index in range(warmups + repeats):
                version += 1
                replicas.send(count, ("sync", version, 600.0))  # waiting, as in a run
                time.sleep(WAITING_S)
                began = time.monotonic()
                stall = sink.publish(params, version)
                replies = replicas.gather(count)
                run = {
                    "stall_s": stall,
                    "loaded_s": max(r[1] for r in replies) - began,
                    # the try that loaded it, from its start (or the publish's, if later)
                    "replica_s": statistics.mean(r[1] - max(r[4], began) for r in replies),
                    "load_s": statistics.mean(r[2] for r in replies),
                    "tries": max(r[3] for r in replies),
                    # from the publish's start to that try's
                    "waited_s": statistics.mean(max(0.0, r[4] - began) for r in replies),
                }
                if index < warmups:
                    if count == counts[0]:  # the first publishes of this shape: fresh memory
                        result["stalls_cold_s"].append(stall)
                    if index in (0, warmups - 1):  # the replicas hold the learner's bytes:
                        # after the first publish, and after one shm and collective follow
                        crcs = replicas.ask(count, ("crc",))
                        if any(crc != expect for crc in crcs):
                            raise AssertionError(f"{path}: a replica loaded other bytes")
                    continue
                runs.append(run)
            loaded = statistics.median(r["loaded_s"] for r in runs)
            replica = statistics.median(r["replica_s"] for r in runs)
            result[f"replicas_{count}"] = {
                "replicas": count,
                "loaded_s": loaded,
                "loaded_gbps": count * nbytes / loaded / GB,
                "replica_s": replica,
                "replica_gbps": nbytes / replica / GB,
                "load_s": statistics.median(r["load_s"] for r in runs),
                "waited_s": statistics.median(r["waited_s"] for r in runs),
                "runs": runs,
                "verified": True,
            }
            print(
                f"    {path:10s} {count} replica(s): publish->loaded {loaded:.3f}s "
                f"({count * nbytes / loaded / GB:.2f} GB/s), replica {replica:.3f}s, "
                f"stall {statistics.median(r['stall_s'] for r in runs):.3f}s",
                flush=True,
            )
        result["sink_stats"] = sink.stats()
    finally:
        with contextlib.suppress(Exception):
            replicas.ask(most, ("close",))
        sink.close()
        trim_memory()
    return result, version


# --------------------------------------------------------------------------
# the link's own limit: a bare gloo broadcast of the same bytes


def _gloo_group(store, rank: int, timeout_s: float = 120.0):
    import datetime

    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._threads = 1  # as asyncrl.weights.collective.groups.make_group
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _gloo_receiver(port: int, nbytes: int, bucket_bytes: int, repeats: int) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(60))
    group = _gloo_group(store, 1)
    flat = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(repeats + 1):
        for start in range(0, nbytes, bucket_bytes):
            group.broadcast(flat[start : start + bucket_bytes], 0).wait()
        group.barrier().wait()


def raw_gloo_gbps(nbytes: int, bucket_bytes: int, repeats: int) -> list[float]:
    """GB/s of a bare gloo broadcast of ``nbytes`` in ``bucket_bytes`` buckets from this
    process to one other (loopback TCP, warm buffers on both ends): the collective path's
    ceiling on this machine. The first pass is untimed."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(60)
    )
    spawn = mp.get_context("spawn")
    process = spawn.Process(
        target=_gloo_receiver, args=(store.port, nbytes, bucket_bytes, repeats), daemon=True
    )
    process.start()
    group = _gloo_group(store, 0)
    flat = torch.ones(nbytes, dtype=torch.uint8)
    runs = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for start in range(0, nbytes, bucket_bytes):
            group.broadcast(flat[start : start + bucket_bytes], 0).wait()
        group.barrier().wait()
        runs.append(nbytes / (time.perf_counter() - started) / GB)
    process.join(timeout=30)
    del group, flat, store
    trim_memory()
    return runs[1:]
