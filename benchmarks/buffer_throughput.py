"""Buffer ingest rate and batch formation latency, next to raw pyzmq over the same bytes.

::

    .venv/bin/python benchmarks/buffer_throughput.py           # full run, a few minutes
    .venv/bin/python benchmarks/buffer_throughput.py --quick   # smoke run, under 30 s
    .venv/bin/python benchmarks/buffer_throughput.py \
        --out docs/benchmarks/buffer.json --markdown docs/benchmarks.md

Processes, all on 127.0.0.1:

- buffer: the production service, started as ``asyncrl launch`` starts it
  (``python -m asyncrl.run.roles buffer RUN_DIR`` with a resolved ``config.yaml``
  holding ``cluster.keys_dir``, and handed its credentials over a pipe by
  ``provision_run`` and ``handed_over``, as the launcher does): it
  authenticates every peer and validates every message
  (``asyncrl.buffer.validation``);
- echo: a bare pyzmq ROUTER that answers each message with the bytes of the
  buffer's ``Ack``: the ceiling for the same messages over the same transport;
- sender: a separate process (multiprocessing spawn) that speaks the real
  protocol with the learner's and the generators' credentials (``client_context``,
  both held by it as the launcher would hand them to each): as a generator
  (role ``generator``, one incarnation from ``new_incarnation``) it asks for
  work (``WorkRequest``), sends one ``Trajectories`` message per group or per
  trajectory for the granted groups (encoded by ``asyncrl.core.messages.encode``, as
  a generator does), waits for every ``Ack``; and as the learner (role
  ``learner``) it asks for batches (``BatchRequest``).

Every message is one the buffer accepts: each sample's prompt ids are the
prompt its group was handed out with (the quickstart's digits task: a few
tokens), the rest of the trajectory is response (within
``generators.max_new_tokens``, raised to the largest size measured), token ids
are within the policy's vocabulary (the tiny model's), log-probs are those of
sampled tokens (<= 0) and token versions are the current policy's. The echo
server gets the very same messages (its groups' prompts made by the same
``work_item_factory`` the buffer uses), unauthenticated: PLAIN credentials are
checked once per connection, at the handshake, so the difference per message is
the buffer's own work, its role check and validation of every message included.

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
refused; the run checks that every sample was accepted, no message rejected
and nothing dropped.
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

from asyncrl.buffer.validation import model_vocab_size
from asyncrl.config import Config, load_config, save_config
from asyncrl.core.credentials import Credentials, handed_over, hold
from asyncrl.core.messages import (
    Ack,
    BatchRequest,
    Trajectories,
    TrajectoryMeta,
    WorkGrant,
    WorkItem,
    WorkRequest,
    decode,
    encode,
    new_incarnation,
)
from asyncrl.core.security import GENERATOR, LEARNER, client_context, provision_run
from asyncrl.core.transport import client_socket, free_port, tcp
from asyncrl.generation.tasks import work_item_factory

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

REPO = Path(__file__).resolve().parents[1]
GROUP_SIZE = 8
PROMPTS_PER_STEP = 32
SAMPLES_PER_STEP = GROUP_SIZE * PROMPTS_PER_STEP  # one learner batch: 256 samples
CHUNK_GROUPS = PROMPTS_PER_STEP  # work is asked for one batch's worth of groups at a time
WINDOW = 32
ECHO_GROUPS = 1024
"""Groups made for the echo server, sent in turn (it checks nothing: ids may repeat)."""
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
"""Tokens per trajectory, prompt and response together."""
PER_MESSAGE = (GROUP_SIZE, 1)
WINDOWS = (1, WINDOW)


# --------------------------------------------------------------------------
# messages


def response_arrays(
    rng: np.random.Generator, response: int, n: int, vocab: int
) -> dict[str, np.ndarray]:
    """The response side of ``n`` trajectories, concatenated as a generator sends them:
    token ids within the policy's vocabulary, log-probs of sampled tokens (<= 0), every
    token made by the current policy (version 0), some masked out."""
    mask = np.ones(n * response, dtype=np.uint8)
    mask[rng.random(n * response) < 0.1] = 0  # some tool/environment tokens, masked out
    return {
        "response_ids": rng.integers(0, vocab, n * response, dtype=np.int32),
        "logprobs": -rng.exponential(1.0, n * response).astype(np.float32),
        "token_versions": np.zeros(n * response, dtype=np.int32),
        "loss_mask": mask,
    }


class Payload:
    """The token arrays of one case's messages, ``per_message`` trajectories of ``tokens``.

    The prompt of each is its group's, as handed out; the response (``tokens``
    less the prompt) is made once per prompt length and reused, so the sender
    spends its time sending, not drawing random numbers.
    """

    def __init__(self, rng: np.random.Generator, tokens: int, per_message: int, vocab: int):
        self.rng = rng
        self.tokens = tokens
        self.per_message = per_message
        self.vocab = vocab
        self.responses: dict[int, dict[str, np.ndarray]] = {}

    def arrays(self, item: WorkItem) -> dict[str, np.ndarray]:
        """The arrays of one message of ``item``'s group."""
        prompt = len(item.prompt_ids)
        if prompt not in self.responses:
            response = self.tokens - prompt
            assert response >= 0, f"a prompt of {prompt} tokens is longer than {self.tokens}"
            self.responses[prompt] = response_arrays(
                self.rng, response, self.per_message, self.vocab
            )
        prompt_ids = np.tile(np.asarray(item.prompt_ids, dtype=np.int32), self.per_message)
        return {"prompt_ids": prompt_ids, **self.responses[prompt]}


def message_frames(
    item: WorkItem,
    first_index: int,
    tokens: int,
    arrays: dict[str, np.ndarray],
    generator: str,
    incarnation: int,
) -> list:
    """One ``Trajectories`` message: samples ``first_index..`` of a group, real encoding."""
    prompt = len(item.prompt_ids)
    n = arrays["prompt_ids"].size // prompt
    metas = [
        TrajectoryMeta(
            item.group_id, first_index + i, prompt, tokens - prompt, 0.5, "stop", generator, 1.0
        )
        for i in range(n)
    ]
    return encode(Trajectories(metas, incarnation=incarnation), arrays)


# --------------------------------------------------------------------------
# sender process


class Peer:
    """A generator-like client: a data socket (windowed) and a work socket (prefetching).

    ``made_up``: None to ask the buffer for work; else the groups are taken from
    it in turn (for the echo server, which hands out nothing): made before any
    timing, as the buffer makes its grants on its own time.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        generator: str,
        incarnation: int,
        made_up: list[WorkItem] | None = None,
    ):
        self.generator = generator
        self.incarnation = incarnation
        self.made_up = made_up
        self.grants = made_up is None
        self.data = client_socket(context, endpoint, REPLY_TIMEOUT_MS / 1000)
        self.work = (
            client_socket(context, endpoint, REPLY_TIMEOUT_MS / 1000) if self.grants else None
        )
        self.pending_grants = 0
        self.next_fake_group = 0
        self.accepted = 0
        self.rejected = 0

    def ask_work(self) -> None:
        if self.grants:
            request = WorkRequest(
                self.generator, CHUNK_GROUPS * GROUP_SIZE, incarnation=self.incarnation
            )
            self.work.send_multipart(encode(request))
            self.pending_grants += 1

    def chunk(self) -> list[WorkItem]:
        """One batch's worth of groups: granted by the buffer, or made up (echo)."""
        if not self.grants:
            start, self.next_fake_group = self.next_fake_group, self.next_fake_group + CHUNK_GROUPS
            return [self.made_up[i % len(self.made_up)] for i in range(start, start + CHUNK_GROUPS)]
        if not self.pending_grants:
            self.ask_work()
        grant, _ = decode(self.work.recv_multipart(copy=False))
        self.pending_grants -= 1
        assert isinstance(grant, WorkGrant), grant
        assert len(grant.items) == CHUNK_GROUPS, f"work refused: {grant}"
        assert all(item.num_samples == GROUP_SIZE for item in grant.items)
        return grant.items

    def collect(self) -> None:
        """Receive one reply on the data socket and count it (a refusal stops the run)."""
        reply, _ = decode(self.data.recv_multipart(copy=False))
        assert isinstance(reply, Ack), f"the server refused a message: {reply}"
        self.accepted += reply.accepted
        self.rejected += reply.rejected

    def settle(self) -> list[WorkItem]:
        """Groups of grants asked for ahead and not used: to be completed, untimed."""
        leftover = []
        while self.pending_grants:
            leftover += self.chunk()
        return leftover

    def close(self) -> None:
        self.data.close(linger=0)
        if self.work is not None:
            self.work.close(linger=0)


def messages_for(items: list[WorkItem], payload: Payload, peer: Peer) -> Iterator[tuple[list, int]]:
    """Each message of the groups ``items``, and the bytes of its token arrays."""
    for item in items:
        arrays = payload.arrays(item)
        nbytes = sum(array.nbytes for array in arrays.values())
        for first in range(0, GROUP_SIZE, payload.per_message):
            frames = message_frames(
                item, first, payload.tokens, arrays, peer.generator, peer.incarnation
            )
            yield frames, nbytes


def stream(
    peer: Peer,
    payload: Payload,
    window: int,
    seconds: float | None = None,
    chunks: int | None = None,
) -> dict:
    """Send whole chunks of groups, ``window`` messages in flight, for ``seconds`` or ``chunks``.

    Work for the next chunk is asked for one chunk ahead, so a grant never
    drains the window. Returns counts and the elapsed time to the last reply.
    """
    per_message = payload.per_message
    outstanding = 0
    sent_traj = sent_msgs = sent_bytes = done_chunks = 0
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
        items = peer.chunk()
        if more_after(done_chunks + 1):
            peer.ask_work()
        for frames, nbytes in messages_for(items, payload, peer):
            if outstanding >= window:
                peer.collect()
                outstanding -= 1
            peer.data.send_multipart(frames, copy=False)
            outstanding += 1
            sent_msgs += 1
            sent_traj += per_message
            sent_bytes += nbytes
        done_chunks += 1
    while outstanding:
        peer.collect()
        outstanding -= 1
    elapsed = time.perf_counter() - start
    leftover = peer.settle()  # complete any group granted ahead, so nothing stays in flight
    for frames, _ in messages_for(leftover, payload, peer):
        peer.data.send_multipart(frames, copy=False)
        peer.collect()
        sent_traj += per_message
    return {
        "messages": sent_msgs,
        "trajectories": sent_msgs * per_message,
        "bytes": sent_bytes,
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


def sender_main(
    config: Config,
    buffer_endpoint: str,
    echo_endpoint: str,
    plan: dict,
    results,
    credentials: Credentials,
) -> None:
    """The sender process: every socket measurement; results go back through ``results``."""
    hold(credentials)  # it plays a generator and the learner
    try:
        results.put(("ok", run_sender(config, buffer_endpoint, echo_endpoint, plan)))
    except BaseException as error:
        import traceback

        results.put(("error", f"{error!r}\n{traceback.format_exc()}"))


def run_sender(config: Config, buffer_endpoint: str, echo_endpoint: str, plan: dict) -> dict:
    # each role's sockets carry its credentials, as client_context gives them to the roles
    generator_context = client_context(config.cluster, GENERATOR)
    learner_context = client_context(config.cluster, LEARNER)
    # the echo server authenticates nobody: a plain context (see the module docstring)
    echo_context = zmq.Context()
    vocab = plan["vocab_size"]
    rng = np.random.default_rng(0)
    incarnation = new_incarnation()  # one generator process: its work and data sockets
    buffer = Peer(generator_context, buffer_endpoint, "bench-gen", incarnation)
    # the echo's groups: prompts as the buffer hands them out (its own work_item_factory)
    make_item = work_item_factory(config)
    echo_items = [make_item(index) for index in range(ECHO_GROUPS)]
    echo = Peer(echo_context, echo_endpoint, "bench-gen", incarnation, echo_items)
    learner = Learner(learner_context, buffer_endpoint)
    ingest, batches = [], []
    prompt_lengths: set[int] = set()
    try:
        for tokens in TOKENS:
            for per_message in PER_MESSAGE:
                payload = Payload(rng, tokens, per_message, vocab)
                for window in WINDOWS:
                    case = {"tokens": tokens, "per_message": per_message, "window": window}
                    # warm up both paths, then measure them in turns, so drift hits both
                    for peer in (echo, buffer):
                        stream(peer, payload, window, chunks=1)
                    seconds = plan["ingest_seconds"] / plan["ingest_rounds"]
                    rounds = []
                    for _ in range(plan["ingest_rounds"]):
                        raw = stream(echo, payload, window, seconds)
                        real = stream(buffer, payload, window, seconds)
                        assert buffer.rejected == 0, f"the buffer refused {buffer.rejected}"
                        assert real["accepted"] == real["sent_total"], real
                        stats = learner.drain(buffer.accepted - learner.taken)
                        assert stats["buffer_held"] == 0.0, stats
                        rounds.append((raw, real))
                    ingest.append(case | summarize(rounds))
                prompt_lengths |= set(payload.responses)
        for held in plan["held_levels"]:
            batches.append(batch_latency(buffer, learner, rng, vocab, held, plan["socket_reps"]))
        final = learner.drain(buffer.accepted - learner.taken)
        assert final["buffer_held"] == 0.0 and final["buffer_dropped_duplicate"] == 0.0, final
        assert final["buffer_accepted"] == buffer.accepted == learner.taken, final
        rejected = {k: v for k, v in final.items() if k.startswith("buffer_rejected_") and v}
        assert not rejected, f"the buffer rejected messages: {rejected}"
        return {
            "ingest": ingest,
            "batch_socket": batches,
            "final_stats": final,
            "prompt_tokens": sorted(prompt_lengths),
        }
    finally:
        for peer in (buffer, echo):
            peer.close()
        learner.sock.close(linger=0)
        for context in (generator_context, learner_context, echo_context):
            context.term()


def summarize(rounds: list[tuple[dict, dict]]) -> dict:
    """Rates over all rounds of a case, and the ratio buffer/raw of each round."""

    def rate(runs: list[dict], key: str = "trajectories") -> float:
        return sum(r[key] for r in runs) / sum(r["seconds"] for r in runs)

    raw_rate = rate([raw for raw, _ in rounds])
    buffer_rate = rate([real for _, real in rounds])
    every = [run for pair in rounds for run in pair]
    return {
        "trajectory_bytes": sum(r["bytes"] for r in every) / sum(r["trajectories"] for r in every),
        "raw_traj_per_s": raw_rate,
        "buffer_traj_per_s": buffer_rate,
        "raw_mb_per_s": rate([raw for raw, _ in rounds], "bytes") / 1e6,
        "buffer_mb_per_s": rate([real for _, real in rounds], "bytes") / 1e6,
        "ratio": buffer_rate / raw_rate,
        "round_ratios": [rate([real]) / rate([raw]) for raw, real in rounds],
        "raw_trajectories": sum(raw["trajectories"] for raw, _ in rounds),
        "buffer_trajectories": sum(real["trajectories"] for _, real in rounds),
        "raw_seconds": sum(raw["seconds"] for raw, _ in rounds),
        "buffer_seconds": sum(real["seconds"] for _, real in rounds),
    }


def batch_latency(
    peer: Peer, learner: Learner, rng: np.random.Generator, vocab: int, held: int, reps: int
) -> dict:
    """Fill the buffer to ``held`` samples, then time batch requests, topping up after each."""
    tokens = 256
    payload = Payload(rng, tokens, GROUP_SIZE, vocab)
    level = -(-held // SAMPLES_PER_STEP)  # whole chunks: held rounds up to a batch multiple
    held_before = peer.accepted - learner.taken
    stream(peer, payload, WINDOW, chunks=level - held_before // SAMPLES_PER_STEP)
    held_now = peer.accepted - learner.taken
    assert held_now == level * SAMPLES_PER_STEP, (held_now, level)
    times = []
    for _ in range(reps):
        elapsed, batch = learner.batch()
        assert batch.stats["buffer_held"] == held_now - SAMPLES_PER_STEP, batch.stats
        assert batch.stats["buffer_dropped_duplicate"] == 0.0
        times.append(elapsed)
        stream(peer, payload, WINDOW, chunks=1)
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


def in_process_batches(config: Config, vocab: int, levels: list[int], reps: int) -> list[dict]:
    """``take_batch`` latency, and the service's whole answer minus the socket, by held samples."""
    from asyncrl.buffer.main import build_store
    from asyncrl.core.trajectory import join_samples, split_samples

    rng = np.random.default_rng(1)
    tokens = 256
    payload = Payload(rng, tokens, GROUP_SIZE, vocab)
    store = build_store(config, work_item_factory(config))

    def add_chunk() -> None:
        for item in store.dispatch("bench-gen", SAMPLES_PER_STEP, now=0.0):
            prompt = len(item.prompt_ids)
            metas = [
                TrajectoryMeta(item.group_id, i, prompt, tokens - prompt, 0.5, "stop", "bench-gen")
                for i in range(GROUP_SIZE)
            ]
            store.ingest(split_samples(metas, payload.arrays(item)), now=0.0)

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


def make_config(run_dir: Path) -> tuple[Config, Credentials]:
    """The quickstart's buffer, refusing nothing, with the run's secret (as ``asyncrl launch``
    writes it) in a ``config.yaml`` the buffer reads when started by hand.

    ``generators.max_new_tokens`` is raised to the largest trajectory measured: the
    buffer refuses a longer response than a generator may make. The sender holds up
    to three chunks of work in flight (the unacknowledged tail of one, the next one
    granted, one more asked for), more than the quickstart's in-flight cap per
    generator (4 x ``generators.max_active_samples``, 512 samples) allows:
    ``max_active_samples`` is raised to one chunk, so no grant is cut short.
    """
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
            f"generators.max_new_tokens={max(TOKENS)}",
            f"generators.max_active_samples={CHUNK_GROUPS * GROUP_SIZE}",
            "cluster.host=127.0.0.1",
            f"cluster.buffer_port={free_port()}",
            f"cluster.weights_port={free_port()}",
            "tracking.aim=false",
        ],
    )
    config, credentials = provision_run(config, run_dir)  # cluster.keys_dir, as at launch
    save_config(config, run_dir / "config.yaml")
    return config, credentials


@contextlib.contextmanager
def buffer_process(run_dir: Path, credentials: Credentials) -> Iterator[subprocess.Popen]:
    log = (run_dir / "buffer.log").open("w")
    env = os.environ | {"ASYNCRL_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "asyncrl.run.roles", "buffer", str(run_dir)]
    with handed_over(credentials.for_role("buffer")) as handover:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env | handover.env,
            pass_fds=handover.fds,
        )
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
        config, credentials = make_config(run_dir)
        plan["vocab_size"] = vocab = model_vocab_size(config)
        assert vocab is not None, "the policy's vocabulary size is unknown"
        buffer_endpoint = tcp("127.0.0.1", config.cluster.buffer_port)
        echo_endpoint = tcp("127.0.0.1", free_port())
        echo = spawn.Process(target=echo_main, args=(echo_endpoint,), daemon=True)
        results = spawn.Queue()
        sender = spawn.Process(
            target=sender_main,
            args=(config, buffer_endpoint, echo_endpoint, plan, results, credentials),
            daemon=True,
        )
        with buffer_process(run_dir, credentials) as buffer:
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
        in_process = in_process_batches(config, vocab, plan["held_levels"], plan["in_process_reps"])
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
            "prompt_tokens": payload["prompt_tokens"],
            "vocab_size": vocab,
            "max_new_tokens": config.generators.max_new_tokens,
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
    prompts = " or ".join(str(n) for n in s["prompt_tokens"])
    lines = [
        f"Measured with `benchmarks/buffer_throughput.py` ({result['mode']} run, "
        f"{result['seconds']:.0f} s): {m['nproc']} CPU cores ({m['cpu']}), GPU: {m['gpu']}, "
        f"Python {m['python']}, pyzmq {m['pyzmq']} (libzmq {m['libzmq']}), "
        f"msgspec {m['msgspec']}, uvloop {m['uvloop']}, numpy {m['numpy']}; "
        f"load average {m['loadavg_start'][0]:.1f} at the start (the machine is shared). "
        "Raw JSON: [`docs/benchmarks/buffer.json`](benchmarks/buffer.json).",
        "",
        "The buffer is the production service in its own process (`python -m asyncrl.run.roles "
        "buffer RUN_DIR`), authenticating its peers with the run's secret and validating every "
        "message; a separate sender process, with the generator's and the learner's "
        "credentials, asks it for work and sends real `Trajectories` messages (prompt ids, "
        "response ids, float32 log-probs, token versions, loss mask) over loopback TCP, waiting "
        "for every `Ack`. Every message is valid: each sample's prompt is the one its group "
        f"was handed out with ({prompts} tokens of the quickstart's digits task), the rest of "
        f"the trajectory is response, token ids are within the tiny model's vocabulary of "
        f"{s['vocab_size']}. In the same run the same sender sends the identical messages to a "
        "bare pyzmq ROUTER, unauthenticated, that answers each with the bytes of an `Ack`: the "
        "raw rate (the credentials are checked once per connection, so the ratio is the "
        "buffer's own cost per message, its role check and validation included). "
        f"Window 1 waits for each reply before the next message (as a generator replica "
        f"does); window {s['window']} keeps {s['window']} messages in flight. "
        f"Each case runs {s['ingest_seconds']:g} s against each server, in "
        f"{s['ingest_rounds']} alternating round(s); every sample sent was accepted.",
        "",
        "### Ingest rate",
        "",
        "| tokens / trajectory | bytes / trajectory | trajectories / message | window | "
        "buffer traj/s | raw pyzmq traj/s | buffer / raw | per round | buffer MB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in result["ingest"]:
        lines.append(
            f"| {row['tokens']} | {row['trajectory_bytes']:,.0f} | {row['per_message']} | "
            f"{row['window']} | "
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
