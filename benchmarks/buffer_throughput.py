"""Buffer ingest rate and batch formation latency, next to raw pyzmq over the same bytes.

::

    .venv/bin/python benchmarks/buffer_throughput.py           # full run, a few minutes
    .venv/bin/python benchmarks/buffer_throughput.py --quick   # smoke run, under 30 s
    .venv/bin/python benchmarks/buffer_throughput.py \
        --out docs/benchmarks/buffer.json --markdown docs/benchmarks.md

Processes, all on 127.0.0.1:

- buffer: the production service, started as ``asyncrl launch`` starts it
  (``python -m asyncrl.roles buffer RUN_DIR`` with a resolved ``config.yaml``);
- echo: a bare pyzmq ROUTER that answers each message with the bytes of the
  buffer's ``Ack``: the ceiling for the same messages over the same transport;
- sender: a separate process (multiprocessing spawn) that speaks the real
  protocol: it asks for work (``WorkRequest``), sends one ``Trajectories``
  message per group or per trajectory for the granted groups (encoded by
  ``asyncrl.messages.encode``, as a generator does), waits for every ``Ack``,
  and as the learner asks for batches (``BatchRequest``).

The sender alternates between the echo server and the buffer for each case,
sending identical messages to both, so the ratio buffer/raw is measured side
by side. With ``window=1`` it waits for each reply before sending the next
message (what a generator replica does); with ``window=32`` it keeps 32
messages in flight, which measures what the receiving side can absorb.

Batch formation is measured with 1k to 100k samples held: in this process on a
``BufferStore`` built by the service's own ``build_store`` (``take_batch``
alone, and everything the service does to answer a batch request except
socket I/O), and over the socket (``BatchRequest`` to ``Trajectories``
received and decoded, in the sender process). After each batch the held
samples are topped up to the level again, untimed.

Admission control is off and the back-pressure bounds are huge, so nothing is
refused; the run checks that every sample was accepted and nothing dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import uvloop
import zmq

from asyncrl.config import Config, load_config, save_config
from asyncrl.messages import (
    Ack,
    BatchRequest,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    WorkRequest,
    decode,
    encode,
)
from asyncrl.transport import client_socket, free_port, tcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

REPO = Path(__file__).resolve().parents[1]
GROUP_SIZE = 8
PROMPTS_PER_STEP = 32
SAMPLES_PER_STEP = GROUP_SIZE * PROMPTS_PER_STEP  # one learner batch: 256 samples
CHUNK_GROUPS = PROMPTS_PER_STEP  # work is asked for one batch's worth of groups at a time
VOCAB = 151_936  # a Qwen-sized vocabulary, for realistic token ids
WINDOW = 32
REPLY_TIMEOUT_MS = 60_000
SECTION = "## Buffer: ingest rate and batch formation"

FULL = {
    "ingest_seconds": 3.0,
    "ingest_rounds": 3,
    "held_levels": [1_000, 10_000, 100_000],
    "socket_reps": 100,
    "in_process_reps": 200,
}
QUICK = {
    "ingest_seconds": 0.4,
    "ingest_rounds": 1,
    "held_levels": [1_000, 10_000],
    "socket_reps": 15,
    "in_process_reps": 30,
}
TOKENS = (256, 4096)
PER_MESSAGE = (GROUP_SIZE, 1)
WINDOWS = (1, WINDOW)


# --------------------------------------------------------------------------
# messages


def trajectory_lengths(tokens: int) -> tuple[int, int]:
    """(prompt, response) tokens of a trajectory of ``tokens``: a quarter prompt."""
    return tokens // 4, tokens - tokens // 4


def trajectory_bytes(tokens: int) -> int:
    prompt, response = trajectory_lengths(tokens)
    return 4 * prompt + (4 + 4 + 4 + 1) * response  # ids; ids, logprobs, versions, mask


def make_arrays(rng: np.random.Generator, tokens: int, n: int) -> dict[str, np.ndarray]:
    """Token arrays of ``n`` trajectories, concatenated as a generator sends them."""
    prompt, response = trajectory_lengths(tokens)
    mask = np.ones(n * response, dtype=np.uint8)
    mask[rng.random(n * response) < 0.1] = 0  # some tool/environment tokens, masked out
    return {
        "prompt_ids": rng.integers(0, VOCAB, n * prompt, dtype=np.int32),
        "response_ids": rng.integers(0, VOCAB, n * response, dtype=np.int32),
        "logprobs": -rng.exponential(1.0, n * response).astype(np.float32),
        "token_versions": np.zeros(n * response, dtype=np.int32),
        "loss_mask": mask,
    }


def message_frames(
    group_id: int, first_index: int, tokens: int, arrays: dict[str, np.ndarray], generator: str
) -> list:
    """One ``Trajectories`` message: samples ``first_index..`` of a group, real encoding."""
    prompt, response = trajectory_lengths(tokens)
    n = arrays["prompt_ids"].size // prompt
    metas = [
        TrajectoryMeta(group_id, first_index + i, prompt, response, 0.5, "stop", generator, 1.0)
        for i in range(n)
    ]
    return encode(Trajectories(metas), arrays)


# --------------------------------------------------------------------------
# sender process


class Peer:
    """A generator-like client: a data socket (windowed) and a work socket (prefetching)."""

    def __init__(self, context: zmq.Context, endpoint: str, generator: str, grants: bool):
        self.generator = generator
        self.grants = grants
        self.data = client_socket(context, endpoint, REPLY_TIMEOUT_MS / 1000)
        self.work = client_socket(context, endpoint, REPLY_TIMEOUT_MS / 1000) if grants else None
        self.pending_grants = 0
        self.next_fake_group = 0
        self.accepted = 0
        self.rejected = 0

    def ask_work(self) -> None:
        if self.grants:
            request = WorkRequest(self.generator, CHUNK_GROUPS * GROUP_SIZE)
            self.work.send_multipart(encode(request))
            self.pending_grants += 1

    def chunk(self) -> list[int]:
        """Group ids of one batch's worth of work: granted by the buffer, or made up (echo)."""
        if not self.grants:
            start, self.next_fake_group = self.next_fake_group, self.next_fake_group + CHUNK_GROUPS
            return list(range(start, start + CHUNK_GROUPS))
        if not self.pending_grants:
            self.ask_work()
        grant, _ = decode(self.work.recv_multipart(copy=False))
        self.pending_grants -= 1
        assert isinstance(grant, WorkGrant), grant
        assert len(grant.items) == CHUNK_GROUPS, f"work refused: {grant}"
        assert all(item.num_samples == GROUP_SIZE for item in grant.items)
        return [item.group_id for item in grant.items]

    def collect(self) -> None:
        """Receive one reply on the data socket and count it."""
        reply, _ = decode(self.data.recv_multipart(copy=False))
        assert isinstance(reply, Ack), reply
        self.accepted += reply.accepted
        self.rejected += reply.rejected

    def settle(self) -> list[int]:
        """Groups of grants asked for ahead and not used: to be completed, untimed."""
        leftover = []
        while self.pending_grants:
            leftover += self.chunk()
        return leftover

    def close(self) -> None:
        self.data.close(linger=0)
        if self.work is not None:
            self.work.close(linger=0)


def messages_for(
    groups: list[int], tokens: int, per_message: int, arrays: dict[str, np.ndarray], generator: str
) -> Iterator[list]:
    for group in groups:
        for first in range(0, GROUP_SIZE, per_message):
            yield message_frames(group, first, tokens, arrays, generator)


def stream(
    peer: Peer,
    tokens: int,
    per_message: int,
    window: int,
    arrays: dict[str, np.ndarray],
    seconds: float | None = None,
    chunks: int | None = None,
) -> dict:
    """Send whole chunks of groups, ``window`` messages in flight, for ``seconds`` or ``chunks``.

    Work for the next chunk is asked for one chunk ahead, so a grant never
    drains the window. Returns counts and the elapsed time to the last reply.
    """
    outstanding = 0
    sent_traj = sent_msgs = done_chunks = 0
    accepted_before = peer.accepted

    def more_after(done: int) -> bool:  # with a count, never ask for work beyond it
        return chunks is None or done < chunks

    if more_after(0):
        peer.ask_work()
    start = time.perf_counter()
    while True:
        if seconds is not None and time.perf_counter() - start >= seconds:
            break
        if not more_after(done_chunks):
            break
        groups = peer.chunk()
        if more_after(done_chunks + 1):
            peer.ask_work()
        for frames in messages_for(groups, tokens, per_message, arrays, peer.generator):
            if outstanding >= window:
                peer.collect()
                outstanding -= 1
            peer.data.send_multipart(frames, copy=False)
            outstanding += 1
            sent_msgs += 1
            sent_traj += per_message
        done_chunks += 1
    while outstanding:
        peer.collect()
        outstanding -= 1
    elapsed = time.perf_counter() - start
    leftover = peer.settle()  # complete any group granted ahead, so nothing stays in flight
    for frames in messages_for(leftover, tokens, per_message, arrays, peer.generator):
        peer.data.send_multipart(frames, copy=False)
        peer.collect()
        sent_traj += per_message
    return {
        "messages": sent_msgs,
        "trajectories": sent_msgs * per_message,
        "seconds": elapsed,
        "sent_total": sent_traj,
        "accepted": peer.accepted - accepted_before,
    }


class Learner:
    def __init__(self, context: zmq.Context, endpoint: str):
        self.sock = client_socket(context, endpoint, REPLY_TIMEOUT_MS / 1000)
        self.taken = 0
        """Samples received in batches so far."""

    def batch(self) -> tuple[float, Trajectories]:
        start = time.perf_counter()
        self.sock.send_multipart(encode(BatchRequest(policy_version=0)))
        reply, arrays = decode(self.sock.recv_multipart(copy=False))
        elapsed = time.perf_counter() - start
        assert isinstance(reply, Trajectories), reply
        assert len(reply.samples) == SAMPLES_PER_STEP
        assert arrays["response_ids"].numpy().size == sum(m.response_len for m in reply.samples)
        self.taken += len(reply.samples)
        return elapsed, reply

    def drain(self, held: int) -> dict[str, float]:
        """Take every held sample (``held`` is a multiple of a batch); the last batch's stats."""
        stats: dict[str, float] = {}
        for _ in range(held // SAMPLES_PER_STEP):
            _, batch = self.batch()
            stats = batch.stats
        return stats


def sender_main(buffer_endpoint: str, echo_endpoint: str, plan: dict, results) -> None:
    """The sender process: every socket measurement; results go back through ``results``."""
    try:
        results.put(("ok", run_sender(buffer_endpoint, echo_endpoint, plan)))
    except BaseException as error:
        import traceback

        results.put(("error", f"{error!r}\n{traceback.format_exc()}"))


def run_sender(buffer_endpoint: str, echo_endpoint: str, plan: dict) -> dict:
    context = zmq.Context()
    rng = np.random.default_rng(0)
    buffer = Peer(context, buffer_endpoint, "bench-gen", grants=True)
    echo = Peer(context, echo_endpoint, "bench-gen", grants=False)
    learner = Learner(context, buffer_endpoint)
    ingest, batches = [], []
    try:
        for tokens in TOKENS:
            for per_message in PER_MESSAGE:
                arrays = make_arrays(rng, tokens, per_message)
                for window in WINDOWS:
                    case = {"tokens": tokens, "per_message": per_message, "window": window}
                    # warm up both paths, then measure them in turns, so drift hits both
                    for peer in (echo, buffer):
                        stream(peer, tokens, per_message, window, arrays, chunks=1)
                    seconds = plan["ingest_seconds"] / plan["ingest_rounds"]
                    rounds = []
                    for _ in range(plan["ingest_rounds"]):
                        raw = stream(echo, tokens, per_message, window, arrays, seconds)
                        real = stream(buffer, tokens, per_message, window, arrays, seconds)
                        assert buffer.rejected == 0, f"the buffer refused {buffer.rejected}"
                        assert real["accepted"] == real["sent_total"], real
                        stats = learner.drain(buffer.accepted - learner.taken)
                        assert stats["buffer_held"] == 0.0, stats
                        rounds.append((raw, real))
                    ingest.append(case | summarize(rounds, tokens))
        for held in plan["held_levels"]:
            batches.append(batch_latency(buffer, learner, rng, held, plan["socket_reps"]))
        final = learner.drain(buffer.accepted - learner.taken)
        assert final["buffer_held"] == 0.0 and final["buffer_dropped_duplicate"] == 0.0, final
        assert final["buffer_accepted"] == buffer.accepted == learner.taken, final
        return {"ingest": ingest, "batch_socket": batches, "final_stats": final}
    finally:
        for peer in (buffer, echo):
            peer.close()
        learner.sock.close(linger=0)
        context.term()


def summarize(rounds: list[tuple[dict, dict]], tokens: int) -> dict:
    """Rates over all rounds of a case, and the ratio buffer/raw of each round."""
    nbytes = trajectory_bytes(tokens)

    def rate(runs: list[dict]) -> float:
        return sum(r["trajectories"] for r in runs) / sum(r["seconds"] for r in runs)

    raw_rate = rate([raw for raw, _ in rounds])
    buffer_rate = rate([real for _, real in rounds])
    return {
        "trajectory_bytes": nbytes,
        "raw_traj_per_s": raw_rate,
        "buffer_traj_per_s": buffer_rate,
        "raw_mb_per_s": raw_rate * nbytes / 1e6,
        "buffer_mb_per_s": buffer_rate * nbytes / 1e6,
        "ratio": buffer_rate / raw_rate,
        "round_ratios": [rate([real]) / rate([raw]) for raw, real in rounds],
        "raw_trajectories": sum(raw["trajectories"] for raw, _ in rounds),
        "buffer_trajectories": sum(real["trajectories"] for _, real in rounds),
        "raw_seconds": sum(raw["seconds"] for raw, _ in rounds),
        "buffer_seconds": sum(real["seconds"] for _, real in rounds),
    }


def batch_latency(
    peer: Peer, learner: Learner, rng: np.random.Generator, held: int, reps: int
) -> dict:
    """Fill the buffer to ``held`` samples, then time batch requests, topping up after each."""
    tokens = 256
    arrays = make_arrays(rng, tokens, GROUP_SIZE)
    level = -(-held // SAMPLES_PER_STEP)  # whole chunks: held rounds up to a batch multiple
    held_before = peer.accepted - learner.taken
    stream(peer, tokens, GROUP_SIZE, WINDOW, arrays, chunks=level - held_before // SAMPLES_PER_STEP)
    held_now = peer.accepted - learner.taken
    assert held_now == level * SAMPLES_PER_STEP, (held_now, level)
    times = []
    for _ in range(reps):
        elapsed, batch = learner.batch()
        assert batch.stats["buffer_held"] == held_now - SAMPLES_PER_STEP, batch.stats
        assert batch.stats["buffer_dropped_duplicate"] == 0.0
        times.append(elapsed)
        stream(peer, tokens, GROUP_SIZE, WINDOW, arrays, chunks=1)
    return {"held": held_now, "tokens": tokens, **percentiles(times)}


def percentiles(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1000
    return {
        "median_ms": float(np.median(ms)),
        "p90_ms": float(np.percentile(ms, 90)),
        "reps": len(ms),
    }


# --------------------------------------------------------------------------
# echo server process


def echo_main(endpoint: str) -> None:
    """Answer every message with the bytes of the buffer's Ack, nothing else."""
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    reply = bytes(encode(Ack(accepted=GROUP_SIZE))[0])
    try:
        while True:
            identity, *_ = sock.recv_multipart(copy=False)
            sock.send_multipart([identity, reply])
    finally:
        sock.close(linger=0)
        context.term()


# --------------------------------------------------------------------------
# in-process batch formation


def in_process_batches(config: Config, levels: list[int], reps: int) -> list[dict]:
    """``take_batch`` latency, and the service's whole answer minus the socket, by held samples."""
    from asyncrl.buffer.service import build_store, join_samples, split_samples
    from asyncrl.tasks import work_item_factory

    rng = np.random.default_rng(1)
    tokens = 256
    prompt, response = trajectory_lengths(tokens)
    arrays = make_arrays(rng, tokens, GROUP_SIZE)
    store = build_store(config, work_item_factory(config))

    def add_chunk() -> None:
        for item in store.dispatch("bench-gen", SAMPLES_PER_STEP, now=0.0):
            metas = [
                TrajectoryMeta(item.group_id, i, prompt, response, 0.5, "stop", "bench-gen")
                for i in range(GROUP_SIZE)
            ]
            store.ingest(split_samples(metas, arrays), now=0.0)

    out = []
    for held in levels:
        while store.held_samples() < held:
            add_chunk()
        take, serve = [], []
        for _ in range(reps):
            start = time.perf_counter()
            batch = store.take_batch()
            took = time.perf_counter()
            stats = store.stats(took)
            metas, joined = join_samples(batch)
            encode(Trajectories(metas, stats), joined)
            done = time.perf_counter()
            assert len(batch) == SAMPLES_PER_STEP
            take.append(took - start)
            serve.append(done - start)
            add_chunk()
        out.append(
            {
                "held": store.held_samples(),
                "take_batch": percentiles(take),
                "serve_without_socket": percentiles(serve),
            }
        )
    assert store.accounted() == store.counters["accepted"]
    return out


# --------------------------------------------------------------------------
# orchestration


def make_config(run_dir: Path) -> Config:
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"algorithm.group_size={GROUP_SIZE}",
            f"algorithm.prompts_per_step={PROMPTS_PER_STEP}",
            "buffer.admission_control=false",
            "buffer.max_staleness=1",
            "buffer.max_held_samples=1000000000",
            f"buffer.max_held_bytes={1 << 40}",
            "buffer.heartbeat_timeout_s=3600",
            "cluster.host=127.0.0.1",
            f"cluster.buffer_port={free_port()}",
            f"cluster.weights_port={free_port()}",
            "tracking.aim=false",
        ],
    )
    save_config(config, run_dir / "config.yaml")
    return config


@contextlib.contextmanager
def buffer_process(run_dir: Path) -> Iterator[subprocess.Popen]:
    log = (run_dir / "buffer.log").open("w")
    env = os.environ | {"ASYNCRL_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "asyncrl.roles", "buffer", str(run_dir)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def machine() -> dict:
    return common.machine_info() | {
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        "numpy": np.__version__,
        "msgspec": msgspec.__version__,
        "uvloop": uvloop.__version__,
        "loadavg_start": common.loadavg(),
    }


def run(quick: bool) -> dict:
    plan = dict(QUICK if quick else FULL)
    info = machine()
    started = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        run_dir = Path(tmp)
        config = make_config(run_dir)
        buffer_endpoint = tcp("127.0.0.1", config.cluster.buffer_port)
        echo_endpoint = tcp("127.0.0.1", free_port())
        echo = spawn.Process(target=echo_main, args=(echo_endpoint,), daemon=True)
        results = spawn.Queue()
        sender = spawn.Process(
            target=sender_main, args=(buffer_endpoint, echo_endpoint, plan, results), daemon=True
        )
        with buffer_process(run_dir) as buffer:
            echo.start()
            try:
                sender.start()
                status, payload = receive(results, sender)
                sender.join(30)
                if status != "ok" or buffer.poll() is not None:
                    log = (run_dir / "buffer.log").read_text()
                    raise RuntimeError(f"sender failed: {payload}\nbuffer log:\n{log}")
            finally:
                for process in (sender, echo):
                    if process.is_alive():
                        process.kill()
                    process.join(10)
        in_process = in_process_batches(config, plan["held_levels"], plan["in_process_reps"])
    socket_by_held = {row["held"]: row for row in payload["batch_socket"]}
    batch_rows = []
    for row in in_process:
        socket_row = socket_by_held.get(row["held"], {})
        batch_rows.append(row | {"socket": {k: socket_row.get(k) for k in percentile_keys()}})
    info["loadavg_end"] = os.getloadavg()
    return {
        "machine": info,
        "mode": "quick" if quick else "full",
        "seconds": time.perf_counter() - started,
        "settings": {
            "group_size": GROUP_SIZE,
            "samples_per_step": SAMPLES_PER_STEP,
            "window": WINDOW,
            "ingest_seconds": plan["ingest_seconds"],
            "ingest_rounds": plan["ingest_rounds"],
            "prompt_fraction": 0.25,
            "batch_tokens": 256,
        },
        "ingest": payload["ingest"],
        "batch_formation": batch_rows,
        "buffer_final_stats": payload["final_stats"],
    }


def receive(results, sender) -> tuple[str, object]:
    """The sender's result; an error if it died without one."""
    while True:
        with contextlib.suppress(queue.Empty):
            return results.get(timeout=1.0)
        if not sender.is_alive():
            return "error", f"the sender process exited with {sender.exitcode}"


def percentile_keys() -> tuple[str, ...]:
    return ("median_ms", "p90_ms", "reps")


def markdown(result: dict) -> str:
    m = result["machine"]
    s = result["settings"]
    lines = [
        f"Measured with `benchmarks/buffer_throughput.py` ({result['mode']} run, "
        f"{result['seconds']:.0f} s): {m['nproc']} CPU cores ({m['cpu']}), GPU: {m['gpu']}, "
        f"Python {m['python']}, pyzmq {m['pyzmq']} (libzmq {m['libzmq']}), "
        f"msgspec {m['msgspec']}, uvloop {m['uvloop']}, numpy {m['numpy']}; "
        f"load average {m['loadavg_start'][0]:.1f} at the start (the machine is shared). "
        "Raw JSON: [`docs/benchmarks/buffer.json`](benchmarks/buffer.json).",
        "",
        "The buffer is the production service in its own process (`python -m asyncrl.roles "
        "buffer RUN_DIR`); a separate sender process asks it for work and sends real "
        "`Trajectories` messages (prompt ids, response ids, float32 log-probs, token versions, "
        "loss mask; a quarter of each trajectory is prompt) over loopback TCP, waiting for "
        "every `Ack`. In the same run the same sender sends the identical messages to a bare "
        "pyzmq ROUTER that answers each with the bytes of an `Ack`: the raw rate. "
        f"Window 1 waits for each reply before the next message (as a generator replica "
        f"does); window {s['window']} keeps {s['window']} messages in flight. "
        f"Each case runs {s['ingest_seconds']:g} s against each server, in "
        f"{s['ingest_rounds']} alternating round(s); every sample sent was accepted.",
        "",
        "### Ingest rate",
        "",
        "| tokens / trajectory | trajectories / message | window | buffer traj/s | "
        "raw pyzmq traj/s | buffer / raw | per round | buffer MB/s |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in result["ingest"]:
        lines.append(
            f"| {row['tokens']} | {row['per_message']} | {row['window']} | "
            f"{row['buffer_traj_per_s']:,.0f} | {row['raw_traj_per_s']:,.0f} | "
            f"{row['ratio']:.2f} | {', '.join(f'{r:.2f}' for r in row['round_ratios'])} | "
            f"{row['buffer_mb_per_s']:,.0f} |"
        )
    ratios = [row["ratio"] for row in result["ingest"]]
    lines += [
        "",
        f"Buffer / raw pyzmq over all cases: {min(ratios):.2f} to {max(ratios):.2f} "
        f"(geometric mean {statistics.geometric_mean(ratios):.2f}).",
        "",
        "### Batch formation",
        "",
        f"Latency of forming one batch of {s['samples_per_step']} samples "
        f"({s['batch_tokens']}-token trajectories, groups of {s['group_size']}) against the "
        "samples held: `take_batch` alone on a store built by the service's `build_store`; "
        "the service's whole answer without the socket (`take_batch`, stats, joining the "
        "arrays, encoding); and over the socket, from `BatchRequest` sent to the batch "
        "received and decoded in the sender process. Held samples are topped up after each "
        "batch.",
        "",
        "| held samples | take_batch median / p90 (ms) | service answer without socket "
        "median / p90 (ms) | BatchRequest round trip median / p90 (ms) |",
        "|---:|---:|---:|---:|",
    ]
    for row in result["batch_formation"]:
        take, serve, sock = row["take_batch"], row["serve_without_socket"], row["socket"]
        socket_text = (
            f"{sock['median_ms']:.2f} / {sock['p90_ms']:.2f}"
            if sock.get("median_ms") is not None
            else "n/a"
        )
        lines.append(
            f"| {row['held']:,} | {take['median_ms']:.2f} / {take['p90_ms']:.2f} | "
            f"{serve['median_ms']:.2f} / {serve['p90_ms']:.2f} | {socket_text} |"
        )
    return "\n".join(lines) + "\n"


def replace_section(path: Path, body: str) -> None:
    """Replace the text under the buffer section's heading, up to the next ``## `` heading."""
    text = path.read_text()
    start = text.index(SECTION) + len(SECTION)
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end + 1
    path.write_text(text[:start] + "\n\n" + body + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (under 30 s)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--markdown", type=Path, help=f"replace the '{SECTION}' section of this file"
    )
    args = parser.parse_args(argv)
    result = run(args.quick)
    text = markdown(result)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        replace_section(args.markdown, text)


if __name__ == "__main__":
    main()
