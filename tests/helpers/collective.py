"""A replica process for the collective path's tests: a small torch module as the engine.

The test process is the learner (a :class:`CollectiveSender`, and a ZeroMQ
publisher where a test falls back); :func:`replica_main` runs in a spawned
process and answers commands over a pipe: ``("sync", deadline_s)`` runs one
collective sync, ``("zmq", endpoint)`` one ZeroMQ fetch, ``("params",)`` sends
the module's parameters back.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import traceback

import torch

from asyncrl.core.signing import group_key_pair

LEARNER_KEY, REPLICA_KEY = group_key_pair(b"L" * 32, b"G" * 32)
"""The two sides of the tests' group: the test process as the learner, the replicas."""


def small_model(seed: int, width: int = 16, layers: int = 0) -> torch.nn.Module:
    """``layers`` square layers between two small ones, and a bf16 parameter: two dtypes,
    so two kinds of bucket."""
    torch.manual_seed(seed)
    inner = [torch.nn.Linear(width, width) for _ in range(layers)]
    model = torch.nn.Sequential(torch.nn.Linear(8, width), *inner, torch.nn.Linear(width, 4))
    model.register_parameter("scale", torch.nn.Parameter(torch.randn(6).to(torch.bfloat16)))
    return model


def version_tensors(version: int, width: int = 16, layers: int = 0) -> dict[str, torch.Tensor]:
    """What the learner publishes as ``version``: the module's tensors, seeded by it."""
    model = small_model(version, width, layers)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


class ModuleBackend:
    """The HF backend's weight contract on a plain module (``model``, ``load_weights``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.version = 0
        self.last_load_s = 0.0
        self.homes = None

    def load_weights(self, state_dict, version: int) -> None:
        missing = set(self.model.state_dict()) - set(state_dict)
        if missing:
            raise ValueError(f"missing {sorted(missing)}")
        self.model.load_state_dict(dict(state_dict))
        self.version = version


class HomingBackend(ModuleBackend):
    """Also ``weight_buffers``, as the HF backend: the collective path receives straight
    into the module's tensors (``module_buffers``, the HF backend's own)."""

    def weight_buffers(self, buckets):
        from asyncrl.generators.backend import module_buffers

        self.homes = module_buffers(self.model, buckets, self.homes)
        return self.homes

    def weights_written(self, version: int) -> None:
        self.version = version


@contextlib.contextmanager
def running_replica(address, bucket_bytes: int, width: int, **options):
    """:func:`replica_main` in a spawned process (``options``: its keyword arguments);
    yields the pipe that commands it, and stops it on the way out."""
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(
        target=replica_main,
        args=(address, REPLICA_KEY, bucket_bytes, width, there),
        kwargs=options,
        daemon=True,
    )
    process.start()
    try:
        yield here
    finally:
        here.send(("stop",))
        process.join(30)
        if process.is_alive():  # ours, by its handle
            process.kill()


def command(pipe, *message, within_s: float = 120.0):
    """Send ``message`` to a replica and return its answer."""
    pipe.send(message)
    assert pipe.poll(within_s), f"no answer to {message}"
    return pipe.recv()


def pause_after_buckets(count: int, pipe) -> None:
    """Make this process say ``("in_broadcast", count)`` once ``count`` buckets of a
    transfer arrived, then dawdle, so the test can SIGSTOP it in the middle."""
    import asyncrl.weights.collective.receiver as receiver

    real = receiver.finish
    received = [0]

    def counting(work, timeout_s):
        real(work, timeout_s)
        received[0] += 1
        if received[0] == count:
            pipe.send(("in_broadcast", count))
            time.sleep(1.0)  # stopped in here

    receiver.finish = counting


def replica_main(
    address,
    key,
    bucket_bytes: int,
    width: int,
    pipe,
    *,
    name="replica-0",
    layers=0,
    pause=None,
    homing=False,
) -> None:
    """A replica: a CollectiveSource (and a ZeroMQ client on demand) into a ModuleBackend
    (``homing``: a HomingBackend)."""
    import zmq

    from asyncrl.weights import WeightClient
    from asyncrl.weights.collective.receiver import CollectiveSource
    from asyncrl.weights.zmq.source import ZmqSource

    torch.set_num_threads(1)
    if pause is not None:
        pause_after_buckets(pause, pipe)
    backend = (HomingBackend if homing else ModuleBackend)(small_model(0, width, layers))
    source = CollectiveSource(address, key, name, bucket_bytes=bucket_bytes)
    context = zmq.Context()
    while True:
        command, *args = pipe.recv()
        if command == "stop":
            break
        try:
            if command == "sync":
                started = time.monotonic()
                loaded = source.sync_into(backend, backend.version, started + args[0])
                pipe.send(("ok", None if loaded is None else loaded.version, backend.version))
            elif command == "zmq":
                client = WeightClient(context, args[0], timeout_s=30)
                loaded = ZmqSource(client).sync_into(
                    backend, backend.version, time.monotonic() + 30
                )
                client.close()
                pipe.send(("ok", None if loaded is None else loaded.version, backend.version))
            elif command == "params":
                state = {n: t.detach().clone() for n, t in backend.model.state_dict().items()}
                pipe.send(("ok", state, backend.version))
        except Exception as error:
            pipe.send(
                (
                    "error",
                    type(error).__name__,
                    str(error),
                    getattr(error, "partial", None),
                    getattr(error, "deadline_missed", None),
                    traceback.format_exc()[-2000:],
                    backend.version,
                )
            )
    source.close()
    context.destroy(linger=0)


# ----------------------------------------- the from-slot tests' versions

WIDTH, LAYERS = 32, 4  # 4 KiB per square weight
BUCKET_BYTES = 8 << 10


def assert_holds(pipe, version: int) -> None:
    status, state, held = command(pipe, "params")
    assert status == "ok" and held == version
    for name, tensor in version_tensors(version, WIDTH, LAYERS).items():
        assert torch.equal(state[name], tensor), name
