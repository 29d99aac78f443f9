"""A checkpoint is completed without the buffer when the buffer cannot write its part.

The learner's own state is intact when the buffer dies, so the checkpoint it writes
on the stop must not be lost with the buffer: rank 0 writes ``buffer.json`` from the
newest earlier complete checkpoint's and ``trained_groups.jsonl`` (``trained_since``).
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from pathlib import Path

import pytest
import torch
import zmq

from asyncrl.buffer.durable import check_state
from asyncrl.buffer.store import SKIP_REASONS, BufferStore
from asyncrl.config import load_config
from asyncrl.core.paths import BUFFER_STATE, COMPLETE, TRAINED_GROUPS, checkpoint_dir
from asyncrl.core.transport import tcp
from asyncrl.learner import buffer_client, checkpoint
from asyncrl.learner.buffer_client import BufferClient, BufferStateNotSaved
from asyncrl.learner.checkpointer import BufferState, Checkpointer, Completer
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.policy import Learner
from tests.helpers.buffer_samples import group_samples, make_store


def earlier_checkpoint(run_dir: Path, step: int, state: dict, complete: bool = True) -> Path:
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    (path / BUFFER_STATE).write_text(json.dumps(state))
    if complete:
        (path / COMPLETE).touch()
    return path


def trained_lines(run_dir: Path, steps: dict[int, list[int]], tail: str = "") -> None:
    """Append one trained_groups.jsonl line per step (in the order given)."""
    with (run_dir / TRAINED_GROUPS).open("a") as file:
        for step, groups in steps.items():
            file.write(json.dumps({"step": step, "version": step + 1, "group_ids": groups}) + "\n")
        file.write(tail)


def test_the_buffer_part_is_the_earlier_checkpoints_plus_the_groups_trained_since(tmp_path):
    base = {"cursor": 12, "policy_version": 4, "started_samples": 48,
            "unfinished_groups": [9, 11], "skipped_groups": [], "trained_ahead": []}  # fmt: skip
    earlier_checkpoint(tmp_path, 4, base)
    earlier_checkpoint(tmp_path, 2, {**base, "cursor": 6})  # older: not the base
    earlier_checkpoint(tmp_path, 6, {**base, "cursor": 99}, complete=False)  # a crash's
    trained_lines(tmp_path, {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7], 4: [8, 10],
                             5: [12, 13], 6: [14, 15]})  # fmt: skip
    trained_lines(tmp_path, {5: [9, 12], 6: [11, 13], 7: [14, 15]}, tail='{"step": 8, "gr')

    state, source = checkpoint.reconstruct_buffer_state(tmp_path, 7)

    assert source == checkpoint_dir(tmp_path, 4)
    # steps 4-6 (the last line of each: the resumed attempt's); not 7 (after this checkpoint)
    assert state == {**base, "policy_version": 7, "trained_since": [8, 9, 10, 11, 12, 13],
                     "written_by": "learner"}  # fmt: skip
    assert check_state(state, SKIP_REASONS).trained == {8, 9, 10, 11, 12, 13}


def test_without_an_earlier_checkpoint_the_base_is_a_fresh_start(tmp_path):
    trained_lines(tmp_path, {0: [0, 1], 1: [3, 2], 2: [4, 5]})
    state, source = checkpoint.reconstruct_buffer_state(tmp_path, 2)
    assert source is None
    assert state == {"cursor": 0, "policy_version": 2, "started_samples": 0,
                     "unfinished_groups": [], "trained_since": [0, 1, 2, 3],
                     "written_by": "learner"}  # fmt: skip


def test_a_base_rebuilt_by_the_learner_keeps_its_trained_since(tmp_path):
    base = {"cursor": 4, "policy_version": 2, "started_samples": 16, "unfinished_groups": [3],
            "trained_since": [3, 4], "written_by": "learner"}  # fmt: skip
    earlier_checkpoint(tmp_path, 3, base)
    trained_lines(tmp_path, {3: [5, 6], 4: [7, 8]})
    state, _ = checkpoint.reconstruct_buffer_state(tmp_path, 5)
    assert state["trained_since"] == [3, 4, 5, 6, 7, 8]


def test_a_step_missing_from_trained_groups_leaves_the_checkpoint_incomplete(tmp_path, caplog):
    earlier_checkpoint(tmp_path, 2, {"cursor": 4, "policy_version": 2, "started_samples": 8,
                                     "unfinished_groups": []})  # fmt: skip
    trained_lines(tmp_path, {2: [4], 4: [6]})  # no line for step 3: its groups are unknown
    path = checkpoint_dir(tmp_path, 5)
    path.mkdir()

    assert not checkpoint.complete_without_buffer(tmp_path, path, 5, "no answer")

    assert not (path / BUFFER_STATE).exists()
    assert "trained_groups.jsonl has no line for step(s) 3, trained after step-000002" in (
        caplog.text
    )


def steps_of(store: BufferStore, rng: random.Random, steps: int) -> list[list[int]]:
    """Generators and a learner at work: the group ids of each batch trained."""
    trained = []
    while len(trained) < steps:
        store.dispatch("gen-0", max_samples=rng.choice([2, 4, 6]))
        for group_id in list(store.in_flight):
            if rng.random() < 0.6:
                store.ingest(group_samples(store, group_id, versions=[store.policy_version]))
        batch = store.take_batch()
        if batch is not None:
            trained.append(sorted({sample.meta.group_id for sample in batch}))
            store.set_policy_version(store.policy_version + 1)
    return trained


@pytest.mark.parametrize("seed", range(6))
def test_a_run_resumed_from_a_rebuilt_part_trains_no_group_twice_and_skips_none(tmp_path, seed):
    rng = random.Random(seed)
    store = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    before = steps_of(store, rng, rng.randint(0, 6))
    if before:  # a checkpoint the buffer wrote, at the step reached so far
        earlier_checkpoint(tmp_path, len(before), json.loads(json.dumps(store.durable_state())))
    after = steps_of(store, rng, rng.randint(1, 6))  # then the buffer dies
    trained_lines(tmp_path, dict(enumerate(before + after)))

    state, _ = checkpoint.reconstruct_buffer_state(tmp_path, len(before) + len(after))
    resumed = make_store(group_size=2, samples_per_step=4, max_staleness=1)
    resumed.restore(json.loads(json.dumps(state)))
    later = steps_of(resumed, rng, 8)

    trained = [group for step in before + after + later for group in step]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    pending = set(resumed.durable_state()["unfinished_groups"])
    skipped_over = set(range(resumed.cursor)) - set(trained) - pending
    assert not skipped_over, f"never trained nor pending: {sorted(skipped_over)}"


# ------------------------------------------------------- the learner's side, for real


@pytest.fixture
def learner(ranks: Ranks) -> Learner:
    config = load_config(
        None,
        [
            "model.tiny.num_layers=1",
            "model.tiny.hidden_size=16",
            "model.tiny.intermediate_size=32",
            "model.tiny.num_heads=2",
        ],
    )
    torch.manual_seed(config.run.seed)
    return Learner(config, ranks)


def save_checkpoint(learner: Learner, buffer: BufferState, run_dir: Path) -> None:
    """Checkpoint the learner's version as rank 0 does, ``buffer`` saving its part."""
    keep = learner.config.learner.keep_checkpoints
    Checkpointer(learner, run_dir, Completer(buffer, run_dir, keep)).save()


class DeadBuffer:
    """A buffer that never saves its part: as BufferClient reports a dead one."""

    def save_state(self, step: int, timeout_s: float | None = None) -> None:
        raise BufferStateNotSaved(f"the buffer did not save its part (step {step})")


def test_a_checkpoint_the_buffer_cannot_save_is_completed_by_the_learner(
    tmp_path, learner: Learner, caplog
):
    caplog.set_level(logging.WARNING, logger="asyncrl.learner")
    learner.version = 3  # as after three trained steps
    trained_lines(tmp_path, {0: [0, 1], 1: [2, 3], 2: [4, 5]})

    save_checkpoint(learner, DeadBuffer(), tmp_path)

    path = checkpoint_dir(tmp_path, 3)
    assert (path / COMPLETE).exists()
    state = json.loads((path / BUFFER_STATE).read_text())
    assert state["trained_since"] == [0, 1, 2, 3, 4, 5]
    assert state["written_by"] == "learner"
    assert "the buffer's part was reconstructed by the learner from a fresh start" in caplog.text


def test_a_buffer_part_written_without_an_answer_is_kept(tmp_path, learner: Learner, caplog):
    class WritesThenDies:
        def save_state(self, step: int, timeout_s: float | None = None) -> None:
            (checkpoint_dir(tmp_path, step) / BUFFER_STATE).write_text('{"cursor": 7}')
            raise BufferStateNotSaved("no answer")

    learner.version = 2
    save_checkpoint(learner, WritesThenDies(), tmp_path)
    path = checkpoint_dir(tmp_path, 2)
    assert (path / COMPLETE).exists()
    assert json.loads((path / BUFFER_STATE).read_text()) == {"cursor": 7}
    assert "but the buffer had written its part" in caplog.text


def test_a_checkpoint_that_cannot_be_written_stops_with_one_line_and_leaves_no_directory(
    tmp_path, learner: Learner, monkeypatch
):
    def full_disk(*_, checkpoint_id: Path, **__):
        checkpoint_id.mkdir(parents=True)
        (checkpoint_id / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device", str(checkpoint_id / "__0_0.distcp"))

    monkeypatch.setattr(checkpoint.dcp, "save", full_disk)
    learner.version = 1
    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        save_checkpoint(learner, DeadBuffer(), tmp_path)
    path = checkpoint_dir(tmp_path, 1)
    assert str(raised.value) == (
        f"cannot write checkpoint {path}: No space left on device (errno 28) "
        f"({path / '__0_0.distcp'}); the learner stops"
    )
    assert not path.exists()  # its space given back


def test_a_stop_cuts_a_wait_for_a_silent_buffer_short(monkeypatch):
    monkeypatch.setattr(buffer_client, "FINAL_SAVE_TIMEOUT_S", 0.3)
    context = zmq.Context()
    try:
        silent = context.socket(zmq.ROUTER)  # takes requests, never answers
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        stopping = [False]
        client = BufferClient(context, tcp("127.0.0.1", port), 0, stop=lambda: stopping[0])
        stopping[0] = True  # SIGTERM: the hour-long default wait must not hold the stop
        cut = re.escape("cut to 0.3s by a stop")
        with pytest.raises(BufferStateNotSaved, match=cut):
            client.save_state(5)
        with pytest.raises(TimeoutError, match=cut):
            client.start_eval(1, 5)
    finally:
        context.destroy(linger=0)


def test_a_stop_during_an_adapter_announcement_skips_it_and_the_save_reads_past_its_answer(
    monkeypatch,
):
    from asyncrl.core.messages import Ack, AdapterPublished, SaveBufferState, decode, encode

    monkeypatch.setattr(buffer_client, "FINAL_SAVE_TIMEOUT_S", 0.3)
    context = zmq.Context()
    try:
        late = context.socket(zmq.ROUTER)  # answers only when the test says so
        late.setsockopt(zmq.LINGER, 0)
        port = late.bind_to_random_port("tcp://127.0.0.1")
        stopping = [False]
        client = BufferClient(context, tcp("127.0.0.1", port), 0, stop=lambda: stopping[0])
        stopping[0] = True
        assert client.announce_adapter(3, "a" * 32) is False  # not announced: not published
        peer, *frames = late.recv_multipart()
        assert isinstance(decode(frames)[0], AdapterPublished)
        late.send_multipart([peer, *encode(Ack(accepted=1))])  # its answer, late
        stopping[0] = False
        saving = threading.Thread(target=client.save_state, args=(5, 5.0))
        saving.start()  # its first answer to read is the announcement's
        peer, *frames = late.recv_multipart()
        assert isinstance(decode(frames)[0], SaveBufferState)
        late.send_multipart([peer, *encode(Ack(accepted=1))])
        saving.join(10)
        assert not saving.is_alive() and client.unanswered == 0
        assert client.client.socket.poll(200) == 0  # both answers read: none left over
    finally:
        context.destroy(linger=0)


def test_a_final_policy_that_cannot_be_written_stops_with_one_line(
    tmp_path, learner: Learner, monkeypatch
):
    def full_disk(*_, **__):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(learner.tokenizer, "save_pretrained", full_disk)
    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        learner.save_pretrained(tmp_path / "final")
    assert str(raised.value) == (
        f"cannot write the final policy {tmp_path / 'final'}: No space left on device "
        "(errno 28); the learner stops"
    )
