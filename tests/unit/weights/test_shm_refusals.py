"""A replica checks what it loads from the shared-memory slot, which any process of the
run's user may write: a slot holding NaN, or a layout that is not the model's, is refused,
counted, and the replica keeps serving the version it holds.

The slot is written by a real :class:`ShmWriter` into a folder standing for ``/dev/shm``,
and tampered with the way any process of the run's user can: open the segment file
read-write, map it, write bytes.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch

from asyncrl.core.messages import TensorEntry
from asyncrl.generators.weight_sync import WeightSync
from asyncrl.weights.layout import TORCH_DTYPES
from asyncrl.weights.shm.reader import ShmSource
from asyncrl.weights.shm.writer import ShmWriter
from tests.helpers.weights import EMBEDDING, NAN, holds, make_backend, published, sample, tamper

torch.set_num_threads(1)


class NothingNewer:
    """The chain's last path (ZeroMQ), with nothing newer to give: what shm refuses stays
    refused, so the test sees what the replica does with no good copy anywhere."""

    name = "zmq"

    def sync_into(self, backend, have_version, deadline):
        return None

    def close(self):
        pass


def entries(tensors: dict[str, torch.Tensor]) -> list[TensorEntry]:
    return [
        TensorEntry(name, TORCH_DTYPES[t.dtype], tuple(t.shape), 0, t.numel() * t.element_size())
        for name, t in tensors.items()
    ]


def only_segment(shm_dir: Path) -> Path:
    (segment,) = shm_dir.iterdir()
    return segment


@pytest.fixture
def replica(tmp_path):
    """A learner's writer that published v1, and a replica holding v1 over shm."""
    run_dir, shm_dir = tmp_path / "run", tmp_path / "shm"
    run_dir.mkdir()
    shm_dir.mkdir()
    backend = make_backend()
    writer = ShmWriter(run_dir, shm_dir)
    assert writer.create(entries(published(1)))
    writer.publish(published(1), 1)
    chain = WeightSync([ShmSource(run_dir, shm_dir), NothingNewer()], 30.0, "gen-0")
    assert chain.sync(backend).version == 1
    yield backend, writer, chain, shm_dir
    chain.close()
    writer.close()


def test_nan_written_into_a_complete_slot_is_refused_counted_and_the_old_weights_serve(replica):
    backend, writer, chain, shm_dir = replica
    writer.publish(published(2), 2)
    tamper(only_segment(shm_dir), 2, EMBEDDING, NAN)

    assert chain.sync(backend) is None  # refused: nothing loaded, the replica goes on
    assert backend.version == 1 and holds(backend, published(1))
    stats = chain.stats()
    assert stats["weights_shm_refused_nonfinite"] == 1.0
    assert stats["weights_refused"] == 1.0
    assert all(set(r.token_versions) == {1} for r in sample(backend))  # sampling still works

    assert chain.sync(backend) is None  # the same slot is not checked (or counted) again
    assert chain.stats()["weights_shm_refused_nonfinite"] == 1.0

    writer.publish(published(3), 3)  # a later good version is taken normally
    loaded = chain.sync(backend)
    assert (loaded.version, loaded.path) == (3, "shm") and holds(backend, published(3))
    assert all(set(r.token_versions) == {3} for r in sample(backend))


def test_a_slot_whose_layout_is_not_the_models_is_refused_before_any_weight_changes(replica):
    backend, writer, chain, _ = replica
    wrong = published(2)
    wrong[EMBEDDING] = wrong[EMBEDDING][:, :-1].contiguous()  # one column short
    writer.publish(wrong, 2)

    assert chain.sync(backend) is None
    assert backend.version == 1 and holds(backend, published(1))
    assert chain.stats()["weights_shm_refused_layout"] == 1.0
    sample(backend)


def test_a_slot_of_another_dtype_is_refused_not_converted(replica):
    backend, writer, chain, _ = replica
    as_bf16 = {name: t.to(torch.bfloat16) for name, t in published(2).items()}
    writer.publish(as_bf16, 2)

    assert chain.sync(backend) is None
    assert backend.version == 1 and holds(backend, published(1))
    assert chain.stats()["weights_shm_refused_layout"] == 1.0


def test_a_refused_newest_slot_leaves_the_older_slot_to_load(replica):
    backend, writer, chain, shm_dir = replica
    backend.version = 0  # say the replica still held v0: v1 (the older slot) is newer
    writer.publish(published(2), 2)
    tamper(only_segment(shm_dir), 2, EMBEDDING, NAN)

    loaded = chain.sync(backend)
    assert (loaded.version, loaded.path) == (1, "shm") and holds(backend, published(1))
    assert chain.stats()["weights_shm_refused_nonfinite"] == 1.0


def test_a_followed_write_with_nan_in_a_part_ends_on_the_previous_version_whole(replica):
    backend, writer, chain, _ = replica
    tensors = published(2)
    names = list(tensors)
    poisoned = names[len(names) // 2]
    tensors[poisoned].view(-1)[0] = math.nan  # as if written there while it was followed
    gate = threading.Event()

    def paced():  # the tensors before the poisoned one, then it once the engine took them
        for name in names:
            if name == poisoned:
                assert gate.wait(30)
            yield name, tensors[name]

    load_in_parts = backend.load_weights_in_parts

    def opening_the_gate_after_a_part(names, parts, version):
        def passing():
            for part in parts:
                yield part
                gate.set()  # the engine copied a part of v2 in

        load_in_parts(names, passing(), version)

    backend.load_weights_in_parts = opening_the_gate_after_a_part
    publishing = threading.Thread(target=writer.publish, args=(paced(), 2))
    publishing.start()
    try:
        loaded = chain.sync(backend)  # follows v2, meets the NaN part midway
    finally:
        gate.set()
        publishing.join(30)
    assert gate.is_set()
    # the engine took v2's first parts (a mix), so it reloaded v1 whole from the older slot
    assert loaded is not None and (loaded.version, loaded.path) == (1, "shm")
    assert backend.version == 1 and holds(backend, published(1))
    assert chain.stats()["weights_shm_refused_nonfinite"] == 1.0
    assert chain.sync(backend) is None  # v2, now complete, is not loaded or counted again
    assert chain.stats()["weights_shm_refused_nonfinite"] == 1.0
    assert all(set(r.token_versions) == {1} for r in sample(backend))
