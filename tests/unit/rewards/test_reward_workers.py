"""Reward workers that misbehave: write to their channel, run out of memory, print a
flood, get killed or return something that is not a number. Each costs at most the
sample being scored; every other sample is scored by a fresh worker."""

from __future__ import annotations

import logging
import struct
import textwrap

import numpy as np
import pytest

from asyncrl.config import load_config
from asyncrl.generation.rewards import RewardScorer, Score
from asyncrl.generation.rewards.channel import decode_reply, take_frames

ROGUE_FUNCTIONS = """
import os
import signal
from fractions import Fraction

import numpy as np


def _write_to_sockets(data):
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                os.write(int(name), data)
        except OSError:
            pass


def rogue(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("channel:"):  # on purpose: whatever socket it can find
        _write_to_sockets(bytes.fromhex(solution_str.removeprefix("channel:")))
    if solution_str == "low fds":  # by accident: descriptors it believes are its own
        for fd in range(3, 64):
            try:
                os.write(fd, b"garbage!" * 8)
            except OSError:
                pass
    if solution_str == "8 GiB":
        return float(len(bytes(8 << 30)) > 0)  # calloc'd, never touched: no real memory
    if solution_str == "1 GiB":
        return float(len(bytes(1 << 30)) > 0)
    if solution_str == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if solution_str == "print 100 MB":
        print("x" * 100_000_000)
    if solution_str == "print hello":
        print("hello")
    if solution_str.startswith("return "):
        names = {"np": np, "Fraction": Fraction, "extra_info": extra_info}
        return eval(solution_str.removeprefix("return "), names)
    return 1.0
"""


@pytest.fixture(scope="module")
def rogue(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rogue_rewards.py"
    path.write_text(textwrap.dedent(ROGUE_FUNCTIONS))
    return f"{path}:rogue"


def _score_all(scorer: RewardScorer, samples: list[tuple], timeout_s: float = 60) -> list[Score]:
    """``score_many`` that gives up: a scorer stuck for good fails the test, not hangs it."""
    futures = [scorer.submit(*sample) for sample in samples]
    return [future.result(timeout=timeout_s) for future in futures]


def _score_one(scorer: RewardScorer, solution_str: str) -> Score:
    return _score_all(scorer, [("x", solution_str, "", None)])[0]


def _frame(payload: bytes) -> bytes:
    return struct.pack("!Q", len(payload)) + payload


@pytest.mark.parametrize(
    "garbage",
    [
        b"garbage!" * 4,  # no frame at all
        _frame(b"hello"),  # a frame that is not JSON
        _frame(b'["ready"]'),  # a message out of turn
        _frame(b'[123456, 1.0, null, ""]'),  # a reply for a job it does not have
        _frame(b'[0, 1.0, "error:made_up", ""]'),  # a tag no worker sends
        b"abc",  # less than a frame's header
    ],
    ids=["raw", "not-json", "ready-again", "wrong-job", "unknown-tag", "short"],
)
def test_garbage_on_the_channel_costs_one_sample_and_the_worker(rogue, garbage):
    with RewardScorer(rogue, timeout_s=10) as scorer:
        samples = [("x", "ok", "", None), ("x", f"channel:{garbage.hex()}", "", None)]
        scores = _score_all(scorer, samples + [("x", "ok", "", None)] * 2)
        assert scores[0] == Score(1.0)
        assert scores[1][:2] == (0.0, "error:channel")
        assert scores[2:] == [Score(1.0), Score(1.0)]  # queued behind it: the new worker's
        assert _score_one(scorer, "ok") == Score(1.0)  # and the scorer goes on
        assert scorer.counters["error:channel"] == 1
        assert scorer.counters["errors"] == 1
        assert scorer.counters["workers_started"] == 2


def test_a_partial_frame_does_not_block_the_scorer(rogue):
    # A header promising more than ever comes: the sample times out, nothing else waits.
    partial = struct.pack("!Q", 1000) + b"abc"
    with RewardScorer(rogue, timeout_s=1) as scorer:
        futures = [scorer.submit("x", f"channel:{partial.hex()}", ""), scorer.submit("x", "ok", "")]
        stuck, after = (future.result(timeout=30) for future in futures)
        assert stuck[:2] == (0.0, "error:timeout")
        assert after == Score(1.0)


def test_the_channel_is_out_of_reach_of_writes_to_low_descriptors(rogue):
    with RewardScorer(rogue, timeout_s=10) as scorer:
        scores = _score_all(scorer, [("x", "low fds", "", None), ("x", "ok", "", None)])
        assert scores == [Score(1.0), Score(1.0)]
        assert scorer.counters["workers_started"] == 1


def test_a_function_past_the_memory_limit_fails_and_its_worker_is_replaced(rogue):
    with RewardScorer(rogue, timeout_s=30) as scorer:  # the default limit: 4096 MiB
        big, after, later = _score_all(
            scorer, [("x", "8 GiB", "", None), ("x", "ok", "", None), ("x", "ok", "", None)]
        )
        assert big[:2] == (0.0, "error:memory")
        assert "MemoryError" in big.detail and "memory_limit_mb=4096" in big.detail
        assert after == later == Score(1.0)
        assert scorer.counters["error:memory"] == 1
        assert scorer.counters["workers_started"] == 2


def test_the_memory_limit_comes_from_the_config(rogue):
    config = load_config(
        None, ["model.tiny={}", f"reward.function={rogue}", "reward.memory_limit_mb=512"]
    )
    with RewardScorer.from_config(config.reward) as scorer:
        assert scorer.memory_limit_mb == 512
        big, after = _score_all(scorer, [("x", "1 GiB", "", None), ("x", "ok", "", None)])
        assert big[:2] == (0.0, "error:memory")
        assert after == Score(1.0)


def test_a_killed_worker_names_the_signal(rogue):
    with RewardScorer(rogue, timeout_s=10) as scorer:
        killed, after = _score_all(scorer, [("x", "kill", "", None), ("x", "ok", "", None)])
        assert killed[:2] == (0.0, "error:crashed")
        assert "SIGKILL" in killed.detail
        assert after == Score(1.0)


def test_worker_output_is_read_off_a_pipe_and_logged_in_short_excerpts(rogue, caplog):
    caplog.set_level(logging.INFO, logger="asyncrl.rewards")
    with RewardScorer(rogue, timeout_s=120) as scorer:
        assert _score_one(scorer, "print 100 MB") == Score(1.0)  # the worker never blocks
        assert _score_one(scorer, "print hello") == Score(1.0)
    excerpts = [r.getMessage() for r in caplog.records if "printed" in r.getMessage()]
    assert len(excerpts) == 1  # the second is counted, not logged: one excerpt a minute
    assert "xxxxxxxx" in excerpts[0]
    assert len(excerpts[0]) < 4096
    assert scorer.counters["worker_output_bytes"] == 100_000_001 + len("hello\n")


REWARDS = [
    ("return 1", 1.0),
    ("return 0.25", 0.25),
    ("return -3", -3.0),
    ("return np.float32(0.5)", 0.5),
    ("return np.int64(1)", 1.0),
    ("return Fraction(1, 4)", 0.25),
    ("return {'score': 0.75, 'acc': True}", 0.75),
]
NOT_REWARDS = [
    "return True",
    "return np.True_",
    "return '1.0'",
    "return None",
    "return [1.0]",
    "return np.array([0.5])",
    "return float('inf')",
    "return np.float64('nan')",
    "return {'acc': 1.0}",
    "return {'score': '1'}",
    "return 10**400",  # too large for a float
    "return 10**5000",  # too long even to print
    "return 'x' * 10**7",
    "return list(range(10**6))",
]


def test_only_finite_real_numbers_are_rewards(rogue):
    texts = [text for text, _ in REWARDS] + NOT_REWARDS
    with RewardScorer(rogue, timeout_s=30) as scorer:
        scores = dict(
            zip(texts, _score_all(scorer, [("x", t, "", None) for t in texts]), strict=True)
        )
        for text, reward in REWARDS:
            assert scores[text] == Score(reward), text
        for text in NOT_REWARDS:
            assert scores[text][:2] == (0.0, "error:bad_return"), (text, scores[text])
            assert len(scores[text].detail) <= 600, text  # a huge value is not printed whole
        assert "xxxx" in scores["return 'x' * 10**7"].detail
        assert scorer.counters["error:bad_return"] == len(NOT_REWARDS)
        assert scorer.counters["workers_started"] == 1


# --------------------------------------------------------------------------
# the scorer's checks of what comes off the channel, without a process


def test_frames_that_came_before_garbage_are_still_taken():
    inbox = bytearray(_frame(b'["ready"]') + _frame(b"[]") + b"abc" + bytes(8))
    frames = take_frames(inbox)
    assert next(frames) == b'["ready"]'
    assert next(frames) == b"[]"
    with pytest.raises(ValueError, match="replies are at most"):
        next(frames)


def test_a_partial_frame_waits_for_the_rest():
    inbox = bytearray(_frame(b'["ready"]')[:-2])
    assert list(take_frames(inbox)) == []
    inbox += b'"]'
    assert list(take_frames(inbox)) == [b'["ready"]']
    assert inbox == b""


@pytest.mark.parametrize(
    "payload, message",
    [
        (b'["ready"]', ["ready"]),
        (b'["failed", "no module"]', ["failed", "no module"]),
        (b'[3, 0.5, null, ""]', [3, 0.5, None, ""]),
        (b'[3, 0.0, "error:exception", "boom"]', [3, 0.0, "error:exception", "boom"]),
    ],
)
def test_well_formed_replies_are_read(payload, message):
    assert decode_reply(payload) == message


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"hello",
        b"\xff\xfe",
        b"{}",
        b'["ready", 1]',
        b'["failed"]',
        b'[true, 0.5, null, ""]',  # a bool for a job id
        b'[3, 1, null, ""]',  # workers send floats
        b'[3, NaN, null, ""]',
        b'[3, 1e999, null, ""]',  # json reads this as inf
        b'[3, 0.5, "error:made_up", ""]',
        b"[3, 0.5, null, 7]",
        b'[3, 0.5, null, "", "more"]',
    ],
)
def test_anything_else_is_refused(payload):
    with pytest.raises(ValueError):
        decode_reply(payload)


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling it creates the marker file


def test_a_worker_never_unpickles_what_reaches_its_channel(tmp_path):
    """Job batches are msgpack: a pickle on the channel is refused as data, never run."""
    import pickle
    import socket

    import msgspec

    from asyncrl.generation.rewards.channel import framed
    from asyncrl.generation.rewards.worker import read_job_batch

    marker = tmp_path / "ran"
    scorer_end, worker_end = socket.socketpair()
    with scorer_end, worker_end:
        scorer_end.sendall(framed(pickle.dumps([(0, _RunsCodeWhenUnpickled(str(marker)))])))
        with pytest.raises(msgspec.DecodeError):
            read_job_batch(worker_end)
    assert not marker.exists()


def test_numpy_values_in_a_job_reach_the_function_as_plain_data(rogue):
    """Parquet rows and environments may hold numpy values; they cross as lists/numbers."""
    extra_info = {"ids": np.arange(3), "weight": np.float32(0.5), "nested": [np.int64(7)]}
    seen = "return float(extra_info == {'ids': [0, 1, 2], 'weight': 0.5, 'nested': [7]})"
    with RewardScorer(rogue, timeout_s=30) as scorer:
        (score,) = _score_all(scorer, [("x", seen, "", extra_info)])
    assert (score.reward, score.error) == (1.0, None)


def test_samples_submitted_together_go_to_the_worker_in_one_batch_and_keep_their_order(
    rogue, monkeypatch
):
    import asyncrl.generation.rewards.scorer as scorer_module

    frames = []
    real_encode = scorer_module.encode_jobs

    def counting(jobs):
        frames.append(len(jobs) if jobs is not None else None)
        return real_encode(jobs)

    monkeypatch.setattr(scorer_module, "encode_jobs", counting)
    samples = [("x", f"return {i} / 4", "", None) for i in range(100)]
    samples[7] = ("x", "return None", "", None)  # one bad sample costs only itself
    with RewardScorer(rogue, timeout_s=30) as scorer:
        wakes = []
        real_wake = scorer._wake
        monkeypatch.setattr(scorer, "_wake", lambda: (wakes.append(1), real_wake()))
        scores = [future.result(timeout=60) for future in scorer.submit_many(samples)]
        woken = len(wakes)
    assert woken == 1 and frames[:1] == [100]  # one wake-up, one frame of 100 jobs
    assert [s.reward for s in scores] == [0.0 if i == 7 else i / 4 for i in range(100)]
    assert scores[7].error == "error:bad_return" and scores[8].error is None
