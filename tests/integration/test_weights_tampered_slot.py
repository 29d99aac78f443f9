"""Any process of the run's user can write the shared-memory weights slot. Before replicas
checked what they load, NaN written into the slot was loaded by both generators, which
failed on sampling and were restarted again and again. Now a live run goes on: each replica
refuses such a version, counts it, keeps generating with the version it holds and takes
the next one."""

from __future__ import annotations

import mmap
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from asyncrl.run.status import read_metrics
from asyncrl.weights.shm.segment import (
    HEADER,
    INDEX_DECODER,
    PAGE,
    SHM_DIR,
    SLOT_HEADER,
    SLOT_HEADER_BYTES,
    SLOTS,
    read_pointer,
)
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
POISONED = (3, 6, 9)
"""Versions written over, never two in a row: with ``buffer.max_staleness: 1`` a replica
holding the version before a refused one still produces samples the learner takes."""
NAN = struct.pack("<f", float("nan"))


def write_nan_into(mapped: mmap.mmap, start: int) -> bool:
    """NaN over the first value of every float32 tensor of the slot at ``start``."""
    index_nbytes, data_at = SLOT_HEADER.unpack_from(mapped, start)[3:5]
    index_at = start + SLOT_HEADER_BYTES
    try:
        index = INDEX_DECODER.decode(mapped[index_at : index_at + index_nbytes])
    except Exception:  # the learner is rewriting it: next round
        return False
    for entry in index:
        if entry.dtype == "float32" and entry.nbytes:
            at = start + data_at + entry.offset
            mapped[at : at + 4] = NAN
    return True


def attacker(run_dir: Path, stop: threading.Event, written: dict[int, int]) -> None:
    """Map the run's segment read-write, as any process of its user can, and keep writing
    NaN into the slot holding each of :data:`POISONED`, while the learner writes it and
    after, until the slot is reused."""
    while not stop.is_set() and read_pointer(run_dir) is None:
        time.sleep(0.01)
    name = read_pointer(run_dir)
    if name is None:
        return
    with open(SHM_DIR / name, "r+b") as file, mmap.mmap(file.fileno(), 0) as mapped:
        slot_bytes = HEADER.unpack_from(mapped, 0)[3]
        while not stop.is_set():
            for slot in range(SLOTS):
                start = PAGE + slot * slot_bytes
                version = SLOT_HEADER.unpack_from(mapped, start)[1]
                if version in POISONED and write_nan_into(mapped, start):
                    written[version] = written.get(version, 0) + 1
            time.sleep(0.0005)


@pytest.mark.timeout(660)
def test_nan_written_into_the_slot_during_a_run_is_refused_and_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stop, written = threading.Event(), {}
    writing = threading.Thread(target=attacker, args=(run_dir, stop, written), daemon=True)
    writing.start()
    command = [
        sys.executable, "-m", "asyncrl", "launch", str(REPO / "configs/quickstart.yaml"),
        "run.total_steps=12", "weights.transport=shm", "tracking.aim=false",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    finally:
        stop.set()
        writing.join(10)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert set(written) == set(POISONED), f"the attack did not reach every version: {written}"
    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, 13))
    last = records[-1]
    assert last["generators_restarts_total"] == 0, "a replica failed on the weights it loaded"
    assert last["generators_weights_refused_total"] >= 1  # refused, counted, in metrics.jsonl
    assert last["generators_weights_shm_refused_nonfinite_total"] >= 1
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("generator*"))
    assert "refused: tensor" in logs and "holds NaN" in logs
    assert processes_of(run_dir) == [], "the launcher left processes behind"
