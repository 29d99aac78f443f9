"""The shared-memory weight path: a learner's writer and a replica's reader.

Values are written out by hand: version ``v`` publishes ``w = v * [[1, 2, 3],
[4, 5, 6]]`` (float32), ``b = [v, 2v]`` (int64) and ``h = [v / 2]`` (bfloat16,
exact for these halves), so what a reader loaded says which version it was.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

import asyncrl.weights.shm.writer as shm_writer
from asyncrl.generators.backend import check_state_dict
from asyncrl.weights.shm.reader import ShmSource
from asyncrl.weights.shm.segment import PAGE, POINTER_FILE, PROGRESS_OFFSET
from asyncrl.weights.shm.writer import ShmWriter
from asyncrl.weights.source import PathUnavailable, WeightTransferError

NAMES = {"w", "b", "h"}


def tensors(version: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]) * version,
        "b": torch.tensor([version, 2 * version], dtype=torch.int64),
        "h": torch.tensor([version / 2], dtype=torch.bfloat16),
    }


def expect_version(loaded: dict[str, torch.Tensor], v: int) -> None:
    assert loaded["w"].tolist() == [[1.0 * v, 2.0 * v, 3.0 * v], [4.0 * v, 5.0 * v, 6.0 * v]]
    assert loaded["b"].tolist() == [v, 2 * v]
    assert loaded["h"].dtype == torch.bfloat16 and loaded["h"].tolist() == [v / 2]


class CopyingBackend:
    """Copies what it is handed (as an engine does), checking names like the real ones."""

    def __init__(self, on_load=None):
        self.version = 0
        self.last_load_s = 0.0
        self.weights: dict[str, torch.Tensor] = {}
        self.loads = 0
        self.on_load = on_load

    def load_weights(self, state_dict, version):
        check_state_dict(NAMES, set(), state_dict, version)
        self.weights = {name: tensor.clone() for name, tensor in state_dict.items()}
        self.loads += 1
        if self.on_load is not None:
            self.on_load(self.loads)
        self.version = version


def far() -> float:
    return time.monotonic() + 30.0


@pytest.fixture
def dirs(tmp_path):
    run_dir, shm_dir = tmp_path / "run", tmp_path / "shm"
    run_dir.mkdir()
    shm_dir.mkdir()
    return run_dir, shm_dir


def started_writer(run_dir: Path, shm_dir: Path, versions=(1,)) -> ShmWriter:
    writer = ShmWriter(run_dir, shm_dir)
    assert writer.create(
        [_entry(name, tensor) for name, tensor in tensors(1).items()]
    )  # sized for the layout
    for version in versions:
        writer.publish(tensors(version), version)
    return writer


def _entry(name, tensor):
    from asyncrl.core.messages import TensorEntry
    from asyncrl.weights.layout import TORCH_DTYPES

    nbytes = tensor.numel() * tensor.element_size()
    return TensorEntry(name, TORCH_DTYPES[tensor.dtype], tuple(tensor.shape), 0, nbytes)


# ---------------------------------------------------------------- two processes


def _writer_process(run_dir: str, shm_dir: str, written, read) -> None:
    writer = started_writer(Path(run_dir), Path(shm_dir), versions=())
    for version in (1, 2, 3):
        writer.publish(tensors(version), version)
        written.put(version)
        assert read.get(timeout=30) == version
    writer.close()
    written.put("closed")


def test_a_writer_and_a_reader_in_two_processes_exchange_three_versions(dirs):
    run_dir, shm_dir = dirs
    spawn = multiprocessing.get_context("spawn")
    written, read = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=_writer_process, args=(str(run_dir), str(shm_dir), written, read))
    child.start()
    try:
        source, backend = ShmSource(run_dir, shm_dir), CopyingBackend()
        for version in (1, 2, 3):
            assert written.get(timeout=60) == version
            loaded = source.sync_into(backend, backend.version, far())
            assert (loaded.version, loaded.path) == (version, "shm")
            assert loaded.published_at == pytest.approx(time.time(), abs=30)
            expect_version(backend.weights, version)
            assert source.sync_into(backend, backend.version, far()) is None  # nothing newer
            read.put(version)
        assert written.get(timeout=30) == "closed"
        with pytest.raises(PathUnavailable):  # retired, removed: the chain goes on to zmq
            source.sync_into(backend, backend.version, far())
        source.close()
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    assert list(shm_dir.iterdir()) == [] and not (run_dir / POINTER_FILE).exists()


# ---------------------------------------------------------------- overlapping writes


def test_a_read_overlapped_by_a_write_is_discarded_and_read_again(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir, versions=(1, 2))  # v1 in slot 0, v2 in slot 1
    held, release = threading.Event(), threading.Event()

    def held_halfway(version):
        yield "w", tensors(version)["w"]
        held.set()
        release.wait(30)
        yield from list(tensors(version).items())[1:]

    half_done = threading.Thread(target=lambda: None)

    def write_during_the_first_load(load: int) -> None:
        nonlocal half_done
        if load == 1:  # the reader holds v2 (slot 1): v3 fills slot 0, v4 starts on slot 1
            writer.publish(tensors(3), 3)
            half_done = threading.Thread(target=writer.publish, args=(held_halfway(4), 4))
            half_done.start()
            assert held.wait(30)

    source, backend = ShmSource(run_dir, shm_dir), CopyingBackend(write_during_the_first_load)
    try:
        loaded = source.sync_into(backend, 0, far())
        assert loaded.version == 3  # slot 1 is mid-write (odd): the newest complete is v3
        assert backend.loads == 2 and source.counters["overlaps"] == 1
        expect_version(backend.weights, 3)
    finally:
        release.set()
        half_done.join(30)
    assert source.sync_into(backend, 3, far()).version == 4  # finished now
    expect_version(backend.weights, 4)
    source.close()
    writer.close()


def test_two_overlapped_reads_in_a_row_raise_a_partial_load(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir, versions=(1, 2))
    published = [2]

    def rewrite_both_slots(_load: int) -> None:
        for _ in range(2):
            published[0] += 1
            writer.publish(tensors(published[0]), published[0])

    source, backend = ShmSource(run_dir, shm_dir), CopyingBackend(rewrite_both_slots)
    with pytest.raises(WeightTransferError, match="rewrote the slot during two loads") as caught:
        source.sync_into(backend, 0, far())
    assert caught.value.partial and backend.loads == 2
    source.close()
    writer.close()


# ---------------------------------------------------------------- following a write


class PartsBackend(CopyingBackend):
    """An engine that loads in parts (as the HF backend does), noting when each part came."""

    def __init__(self):
        super().__init__()
        self.parts: list[list[str]] = []

    def load_weights_in_parts(self, names, parts, version):
        check_state_dict(NAMES, set(), dict.fromkeys(names), version)
        for part in parts:
            self.parts.append(list(part))
            self.weights.update({name: tensor.clone() for name, tensor in part.items()})
        self.version = version


def paced(version: int, gates: list[threading.Event], reached: list[threading.Event]):
    """``tensors(version)`` one at a time: before tensor i, say so and wait for gate i."""
    for index, item in enumerate(tensors(version).items()):
        reached[index].set()
        assert gates[index].wait(30)
        yield item


def test_a_reader_follows_a_write_loading_each_tensor_before_the_next_is_written(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir, versions=(1, 2))  # v2 announces the layout
    gates = [threading.Event() for _ in NAMES]
    reached = [threading.Event() for _ in NAMES]
    publishing = threading.Thread(target=writer.publish, args=(paced(3, gates, reached), 3))
    source, backend = ShmSource(run_dir, shm_dir), PartsBackend()
    backend.version = 2
    publishing.start()
    try:
        gates[0].set()
        assert reached[1].wait(30)  # "w" written, "b" held back
        # an engine that cannot load in parts finds nothing newer than v2 yet
        assert source.sync_into(CopyingBackend(), 2, far()) is None

        def release_each_after_its_part():
            for index in (1, 2):
                while len(backend.parts) < index:
                    time.sleep(0.001)
                gates[index].set()

        releasing = threading.Thread(target=release_each_after_its_part)
        releasing.start()
        loaded = source.sync_into(backend, 2, far())
        releasing.join(30)
    finally:
        for gate in gates:
            gate.set()
        publishing.join(30)
    assert (loaded.version, loaded.path) == (3, "shm") and backend.version == 3
    assert backend.parts == [["w"], ["b"], ["h"]]  # each loaded before the next was written
    assert source.counters["followed"] == 1 and source.counters["overlaps"] == 0
    expect_version(backend.weights, 3)
    source.close()
    writer.close()


def test_progress_counts_bytes_written_also_within_a_large_tensor(dirs, monkeypatch):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir, versions=(1,))  # v2 follows v1's layout
    monkeypatch.setattr(shm_writer, "WRITE_PIECE", 8)
    marked: list[int] = []
    real_write_u64 = shm_writer.write_u64

    def noting(buffer, offset, value):
        if offset % PAGE == PROGRESS_OFFSET:
            marked.append(value)
        real_write_u64(buffer, offset, value)

    monkeypatch.setattr(shm_writer, "write_u64", noting)
    writer.publish(tensors(2), 2)
    # w: 24 bytes at 0, in pieces of 8; b: 16 bytes at 64, in pieces of 8; h: 2 bytes at 128
    assert marked == [8, 16, 24, 24, 72, 80, 80, 130]
    source = ShmSource(run_dir, shm_dir)
    source.ensure_mapped()
    slot = source.newest()
    assert slot.version == 2 and source.progress(slot) == slot.data_nbytes == 130  # complete
    backend = PartsBackend()
    backend.version = 1
    writer.publish(tensors(3), 3)  # complete: nothing to follow, loaded whole
    assert source.sync_into(backend, 2, far()).version == 3
    expect_version(backend.weights, 3)
    source.close()
    writer.close()


def test_a_write_that_leaves_its_announced_layout_is_loaded_whole_after_the_mix(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir, versions=(1, 2))
    gates = [threading.Event() for _ in range(2)]
    reached = [threading.Event() for _ in range(2)]

    def grown(version):  # "b" grows: the write leaves the layout it announced
        yield "w", tensors(version)["w"]
        reached[0].set()
        assert gates[0].wait(30)
        yield "b", torch.tensor([version, 2 * version, 3 * version])
        reached[1].set()
        assert gates[1].wait(30)  # held until the reader is done
        yield "h", tensors(version)["h"]

    publishing = threading.Thread(target=writer.publish, args=(grown(3), 3))
    source, backend = ShmSource(run_dir, shm_dir), PartsBackend()
    backend.version = 2
    publishing.start()
    try:
        assert reached[0].wait(30)
        threading.Timer(0.2, gates[0].set).start()  # once the reader follows
        loaded = source.sync_into(backend, 2, far())
        assert reached[1].wait(30)  # the write went on past "b", held before "h"
    finally:
        for gate in gates:
            gate.set()
        publishing.join(30)
    assert backend.parts[0] == ["w"]  # v3's "w" was loaded: the engine held a mix
    assert loaded.version == 2 and backend.version == 2  # then v2 whole, from its slot
    expect_version(backend.weights, 2)
    assert source.counters["overlaps"] == 1 and source.counters["followed"] == 0
    assert source.sync_into(backend, 2, far()).version == 3  # complete now: read whole
    assert backend.weights["b"].tolist() == [3, 6, 9]
    source.close()
    writer.close()


def test_a_followed_write_that_stalls_past_the_deadline_is_a_partial_load(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir, versions=(1, 2))
    gates = [threading.Event() for _ in NAMES]
    reached = [threading.Event() for _ in NAMES]
    gates[0].set()  # "w" is written, then the learner stalls
    publishing = threading.Thread(target=writer.publish, args=(paced(3, gates, reached), 3))
    source, backend = ShmSource(run_dir, shm_dir), PartsBackend()
    backend.version = 2
    publishing.start()
    try:
        assert reached[1].wait(30)
        with pytest.raises(WeightTransferError, match="deadline") as caught:
            source.sync_into(backend, 2, time.monotonic() + 0.3)
    finally:
        for gate in gates:
            gate.set()
        publishing.join(30)
    assert caught.value.partial and caught.value.deadline_missed
    assert backend.parts == [["w"]] and backend.version == 2
    source.close()
    writer.close()


# ---------------------------------------------------------------- what a reader refuses


def patch(shm_dir: Path, offset: int, data: bytes) -> None:
    (segment,) = shm_dir.iterdir()
    with open(segment, "r+b") as file, mmap.mmap(file.fileno(), 0) as mapped:
        mapped[offset : offset + len(data)] = data


def test_a_corrupted_header_is_refused_naming_it(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir)
    patch(shm_dir, 0, b"NOTMAGIC")
    with pytest.raises(WeightTransferError, match=r"corrupt header.*NOTMAGIC"):
        ShmSource(run_dir, shm_dir).sync_into(CopyingBackend(), 0, far())
    writer.close()


def test_a_slot_whose_data_is_smaller_than_its_index_says_is_refused(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir)  # v1 in slot 0
    # slot 0's data_nbytes (slot header field 6, byte 40) set to 8: 'w' is 24 bytes
    patch(shm_dir, PAGE + 40, struct.pack("<Q", 8))
    backend = CopyingBackend()
    with pytest.raises(WeightTransferError, match="tensor 'w' ends at byte 24, past the slot's 8"):
        ShmSource(run_dir, shm_dir).sync_into(backend, 0, far())
    assert backend.loads == 0
    writer.close()


def test_wrong_names_are_refused_before_any_weight_changes(dirs):
    run_dir, shm_dir = dirs
    writer = ShmWriter(run_dir, shm_dir)
    wrong = {"w": tensors(1)["w"], "x": torch.zeros(2)}
    assert writer.create([_entry(name, tensor) for name, tensor in wrong.items()])
    writer.publish(wrong, 1)
    with pytest.raises(WeightTransferError, match=r"missing \['b', 'h'\], extra \['x'\]") as caught:
        ShmSource(run_dir, shm_dir).sync_into(CopyingBackend(), 0, far())
    assert not caught.value.partial
    writer.close()


def test_a_segment_others_may_open_is_refused(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir)
    ((segment,),) = [list(shm_dir.iterdir())]
    assert segment.stat().st_mode & 0o777 == 0o600  # created owner-only
    os.chmod(segment, 0o644)
    with pytest.raises(WeightTransferError, match="open to others"):
        ShmSource(run_dir, shm_dir).sync_into(CopyingBackend(), 0, far())
    writer.close()


def test_no_segment_yet_is_unavailable_not_a_failure(dirs):
    run_dir, shm_dir = dirs
    with pytest.raises(PathUnavailable):
        ShmSource(run_dir, shm_dir).sync_into(CopyingBackend(), 0, far())
    with pytest.raises(PathUnavailable):
        ShmSource(None, shm_dir).sync_into(CopyingBackend(), 0, far())


def test_a_crashed_learners_segment_is_removed_by_the_next_one_of_the_run_dir(dirs):
    run_dir, shm_dir = dirs
    crashed = started_writer(run_dir, shm_dir)  # never closed: a crash
    leftover = shm_dir / crashed.name
    assert leftover.exists()
    again = ShmWriter(run_dir, shm_dir)
    assert not leftover.exists() and not (run_dir / POINTER_FILE).exists()
    again.close()


def test_a_version_that_outgrows_the_slots_retires_the_segment_and_keeps_every_tensor(dirs):
    run_dir, shm_dir = dirs
    writer = started_writer(run_dir, shm_dir)
    bigger = tensors(2) | {"w": torch.arange(4096, dtype=torch.float32)}  # past the page
    written = dict(writer.publish(bigger, 2))
    assert writer.retired and set(written) == NAMES
    assert written["w"].tolist() == list(range(4096)) and written["b"].tolist() == [2, 4]
    with pytest.raises(PathUnavailable, match="retired"):
        ShmSource(run_dir, shm_dir).sync_into(CopyingBackend(), 0, far())
    writer.close()


def test_zeromq_copies_the_newest_version_from_shared_memory_only_when_asked(dirs):
    import zmq

    from asyncrl.core.transport import free_port, tcp
    from asyncrl.weights import WeightClient, WeightPublisher
    from asyncrl.weights.shm.publisher import ShmPublisher

    run_dir, shm_dir = dirs
    publisher = WeightPublisher(tcp("127.0.0.1", free_port()))
    sink = ShmPublisher(publisher, ShmWriter(run_dir, shm_dir))
    context = zmq.Context()
    client = WeightClient(context, publisher.endpoint, timeout_s=30.0)
    try:
        for version in (1, 2, 3):  # v1 sizes the segment (zmq first), v2 and v3 stream in
            assert sink.publish(iter(tensors(version).items()), version) >= 0.0
            backend = CopyingBackend()
            assert ShmSource(run_dir, shm_dir).sync_into(backend, 0, far()).version == version
            expect_version(backend.weights, version)
        assert sink.version == 3 and publisher.snapshots.newest().version == 1  # no copy yet
        fetched = client.fetch_newer(1)  # a replica elsewhere asks: v3 is copied for it
        assert fetched is not None and fetched[0] == 3
        expect_version(fetched[2], 3)
        assert client.fetch_newer(3) is None
        stats = sink.stats()
        assert stats["weights_shm_published_total"] == 3.0
        assert stats["weights_shm_zmq_copies_total"] == 1.0  # v3 only: v2 was never asked for
    finally:
        client.close()
        context.term()
        sink.close()
    assert list(shm_dir.iterdir()) == []
