"""Weight sync by each path (zmq, shm, collective) against a memory copy, and the learner's stall.

    .venv/bin/python benchmarks/weights_publish.py            # full run, writes docs
    .venv/bin/python benchmarks/weights_publish.py --quick    # 10M, all paths, under a minute
    .venv/bin/python benchmarks/weights_publish.py --render docs/benchmarks/weights_publish.json

Models: synthetic llama-shaped fp32 models of about 100M and 500M parameters,
the real policy, SmolLM2-135M-Instruct (its own tensors, read from
``models/SmolLM2-135M-Instruct``), and ``SmolLM2-LoRA16``: what a sync of that
policy moves with ``model.lora`` at rank 16 on every linear layer (the adapters
alone, as ``model.lora.publish: adapter`` publishes them; the replicas' stand-in
holds their names and shapes, as the HF engine's LoRA layers do). For each model and each path
(``weights_paths.py`` says how a path is driven, exactly as a run drives it),
measured in the same run, side by side:

- memcpy: ``dst.copy_(src)`` of the same tensors into warm preallocated buffers,
  before the paths and again after them (the drift between the two is shown);
- publish to loaded: from the learner's ``publish`` call to the last replica's
  tensors loaded into a module of the policy's shapes (``sync_into`` of the
  path's source into a stand-in of the HF backend, loading as it does), the
  replicas already waiting for the version when the publish starts, with one
  and with ``--replicas`` replicas, as GB/s (replicas x bytes / seconds) and as
  a ratio to memcpy; also the replica's own part: the ``sync_into`` that loaded
  the version, from its start (or the publish's, if later);
- stall: the seconds ``publish`` blocks the learner, as a multiple of the
  memcpy of the policy and as a share of a training step of the same model
  (synthetic: forward and backward of one ``--tokens``-token sequence through
  the llama-shaped layers plus a fused AdamW update; real: the HF model's
  forward and backward of ``--tokens`` tokens plus a fused AdamW update).

Every replica's loaded bytes are checked against the learner's (crc32 of the
whole state dict) on the first publish of each path and model.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import zmq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402  (benchmarks/ is not a package: found on sys.path)
from weights_paths import PATHS, Replicas, measure_path, raw_gloo_gbps, trim_memory  # noqa: E402

from asyncrl.weights import DEFAULT_CHUNK_BYTES  # noqa: E402

GB = 1e9
SIZES = {  # name: (hidden, layers, vocab)
    "10M": (320, 4, 8192),
    "100M": (768, 8, 32000),
    "500M": (1280, 20, 32000),
}
LAYER_WEIGHTS = (
    "attn_norm",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.o",
    "mlp_norm",
    "mlp.gate",
    "mlp.up",
    "mlp.down",
)
REAL = "SmolLM2-135M"
REAL_LORA = "SmolLM2-LoRA16"
LORA_RANK = 16
REAL_DIR = ROOT / "models" / "SmolLM2-135M-Instruct"
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Weight publishing: bandwidth and learner stall"


# --------------------------------------------------------------------------
# the model: llama-shaped fp32 tensors and one training step over them


def build_model(hidden: int, layers: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    ffn = (8 * hidden // 3 + 255) // 256 * 256
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return (torch.rand(rows, cols, generator=generator) - 0.5) * (2 / math.sqrt(cols))

    params = {"embed.weight": matrix(vocab, hidden)}
    for index in range(layers):
        prefix = f"layers.{index}."
        params[prefix + "attn_norm.weight"] = torch.ones(hidden)
        for name in ("q", "k", "v", "o"):
            params[prefix + f"attn.{name}.weight"] = matrix(hidden, hidden)
        params[prefix + "mlp_norm.weight"] = torch.ones(hidden)
        params[prefix + "mlp.gate.weight"] = matrix(ffn, hidden)
        params[prefix + "mlp.up.weight"] = matrix(ffn, hidden)
        params[prefix + "mlp.down.weight"] = matrix(hidden, ffn)
    params["norm.weight"] = torch.ones(hidden)
    params["head.weight"] = matrix(vocab, hidden)
    return params


def loss_of(params: dict[str, torch.Tensor], layers: int, tokens: torch.Tensor) -> torch.Tensor:
    inputs, targets = tokens[:-1], tokens[1:]
    x = params["embed.weight"][inputs]
    length, hidden = x.shape
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for index in range(layers):
        layer = {name: params[f"layers.{index}.{name}.weight"] for name in LAYER_WEIGHTS}
        p = layer.__getitem__
        h = F.rms_norm(x, (hidden,), p("attn_norm"))
        q, k, v = h @ p("attn.q").T, h @ p("attn.k").T, h @ p("attn.v").T
        scores = (q @ k.T / math.sqrt(hidden)).masked_fill(~causal, float("-inf"))
        x = x + (scores.softmax(-1) @ v) @ p("attn.o").T
        h = F.rms_norm(x, (hidden,), p("mlp_norm"))
        x = x + (F.silu(h @ p("mlp.gate").T) * (h @ p("mlp.up").T)) @ p("mlp.down").T
    logits = F.rms_norm(x, (hidden,), params["norm.weight"]) @ params["head.weight"].T
    return F.cross_entropy(logits, targets)


class Trainer:
    """One training step of the synthetic model: forward, backward, fused AdamW."""

    def __init__(self, params: dict[str, torch.Tensor], layers: int, vocab: int, tokens: int):
        self.params, self.layers = params, layers
        for tensor in params.values():
            tensor.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(params.values(), lr=1e-5, fused=True)
        self.tokens = torch.randint(0, vocab, (tokens + 1,), generator=torch.Generator())

    def step(self) -> tuple[float, float]:
        """Seconds for the whole step, and for the optimizer update alone."""
        start = time.perf_counter()
        loss_of(self.params, self.layers, self.tokens).backward()
        update = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        end = time.perf_counter()
        return end - start, end - update

    def close(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer = None
        for tensor in self.params.values():
            tensor.requires_grad_(False)
        trim_memory()


class RealTrainer:
    """One training step of the real policy (the HF model): forward, backward, fused AdamW."""

    def __init__(self, params: dict[str, torch.Tensor], tokens: int):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(REAL_DIR)
        self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model.load_state_dict(params, strict=False)  # the head is tied to the embedding
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)
        self.ids = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator())

    def step(self) -> tuple[float, float]:
        start = time.perf_counter()
        self.model(input_ids=self.ids, labels=self.ids).loss.backward()
        update = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        end = time.perf_counter()
        return end - start, end - update

    def close(self) -> None:
        self.model = self.optimizer = None
        trim_memory()


def real_params() -> dict[str, torch.Tensor]:
    """The real policy's tensors, as the learner would publish them (fp32, tied head left out)."""
    from safetensors.torch import load_file

    return {name: t.contiguous() for name, t in load_file(REAL_DIR / "model.safetensors").items()}


# --------------------------------------------------------------------------
# the measurements


def memcpy_runs(tensors: list[torch.Tensor], repeats: int) -> list[float]:
    """GB/s of ``copy_`` of ``tensors`` into warm preallocated buffers, ``repeats`` times."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    targets = [torch.empty_like(t) for t in tensors]
    for target, tensor in zip(targets, tensors, strict=True):  # touch the pages once
        target.copy_(tensor)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for target, tensor in zip(targets, tensors, strict=True):
            target.copy_(tensor)
        runs.append(nbytes / (time.perf_counter() - start) / GB)
    del targets
    trim_memory()
    return runs


class LoraTrainer(RealTrainer):
    """One training step of the real policy with rank-16 LoRA adapters: forward and
    backward through peft's layers, fused AdamW over the adapters only."""

    def __init__(self, tokens: int):
        from asyncrl.config import LoraConfig
        from asyncrl.generation import lora

        super().__init__(real_params(), tokens)
        self.model = lora.with_adapters(self.model, LoraConfig(rank=LORA_RANK), seed=0).train()
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)


def lora_params() -> dict[str, torch.Tensor]:
    """The adapters the learner publishes for the real policy at rank 16 (random values)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config import LoraConfig
    from asyncrl.generation import lora

    model = AutoModelForCausalLM.from_pretrained(REAL_DIR, dtype=torch.float32)
    adapters = lora.inject_adapters(model, LoraConfig(rank=LORA_RANK)).state_dict()
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(t.shape, generator=generator) for name, t in adapters.items()}


def model_params(name: str) -> tuple[dict[str, torch.Tensor], object]:
    """The tensors of model ``name`` and a trainer of one step over them."""
    if name == REAL:
        params = real_params()
        return params, lambda tokens: RealTrainer(params, tokens)
    if name == REAL_LORA:
        return lora_params(), LoraTrainer
    hidden, layers, vocab = SIZES[name]
    params = build_model(hidden, layers, vocab)
    return params, lambda tokens: Trainer(params, layers, vocab, tokens)


def run_model(name: str, args, replicas: Replicas, version: int) -> tuple[dict, int]:
    params, make_trainer = model_params(name)
    tensors = list(params.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    count = sum(t.numel() for t in tensors)
    print(f"[{name}] {count / 1e6:.1f}M parameters, {nbytes / GB:.3f} GB", flush=True)
    result = {"model": name, "params": count, "bytes": nbytes, "tensors": len(tensors)}

    trainer = make_trainer(args.tokens)
    trainer.step()  # optimizer state, first touch
    steps = [trainer.step() for _ in range(args.steps)]
    trainer.close()
    del trainer
    for tensor in params.values():
        tensor.requires_grad_(False)
    result["step_s"] = statistics.median(s for s, _ in steps)
    result["optimizer_s"] = statistics.median(u for _, u in steps)
    print(f"  step {result['step_s']:.3f}s (AdamW {result['optimizer_s']:.3f}s)", flush=True)

    before = memcpy_runs(tensors, args.memcpy_repeats)
    counts = sorted({1, args.replicas if nbytes <= args.many_max_bytes else 1})
    shapes = [(n, tuple(t.shape), t.dtype) for n, t in params.items()]
    replicas.ask(max(counts), ("model", shapes))
    result["paths"] = {}
    for path in args.paths.split(","):
        result["paths"][path], version = measure_path(
            path,
            params,
            replicas,
            counts,
            repeats=args.repeats,
            warmups=args.warmups,
            version=version,
            bucket_bytes=args.bucket_mib << 20,
            chunk_bytes=args.chunk_mib << 20,
        )
        gc.collect()  # the path's snapshots and buffers, before the next one allocates its own
        trim_memory()
    replicas.ask(max(counts), ("model", []))  # the replicas drop this model
    if "collective" in result["paths"]:
        raw = raw_gloo_gbps(nbytes, args.bucket_mib << 20, args.memcpy_repeats)
        result["gloo_raw_gbps"], result["gloo_raw_runs"] = statistics.median(raw), raw
        print(f"  bare gloo broadcast {result['gloo_raw_gbps']:.2f} GB/s", flush=True)
    after = memcpy_runs(tensors, args.memcpy_repeats)
    result["memcpy_before_gbps"] = statistics.median(before)
    result["memcpy_after_gbps"] = statistics.median(after)
    result["memcpy_gbps"] = statistics.median(before + after)
    result["memcpy_s"] = nbytes / result["memcpy_gbps"] / GB
    print(
        f"  memcpy {result['memcpy_before_gbps']:.2f} GB/s before, "
        f"{result['memcpy_after_gbps']:.2f} after",
        flush=True,
    )
    del params, tensors
    trim_memory()
    return result, version


def machine() -> dict:
    return common.machine_info() | {
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_start": common.loadavg(),
    }


GOALS = {"shm": 0.5, "collective": 0.3}
"""Issue 18's goals: publish to loaded against memcpy, one replica (collective: gloo here)."""
STALL_GOAL = 1.2
"""... and the learner's stall per publish, in memcpys of the policy."""


def ratio(result: dict, path: str, count: int, key: str = "loaded_gbps") -> float | None:
    run = result["paths"].get(path, {}).get(f"replicas_{count}")
    return None if run is None else run[key] / result["memcpy_gbps"]


def stall_of(path_result: dict, count: int) -> float | None:
    """The median warm stall of the publishes measured with ``count`` replicas."""
    run = path_result.get(f"replicas_{count}")
    return None if run is None else statistics.median(r["stall_s"] for r in run["runs"])


def markdown(report: dict) -> str:
    m, cfg = report["machine"], report["config"]
    many = cfg["replicas"]
    lines = [
        f"Machine: {m['cpu']}, {m['nproc']} cores, {m['memory_gib']} GiB, shared with other "
        f"work (load average {m['loadavg_start'][0]:.1f} at the start, "
        f"{m.get('loadavg_end', [float('nan')])[0]:.1f} at the end); Python {m['python']}, "
        f"torch {m['torch']} ({m['torch_threads']} thread in the learner, 1 per replica), "
        f"pyzmq {m['pyzmq']} / libzmq {m['libzmq']}. Learner and replicas are processes on "
        f"the same 2 cores; zmq and gloo over loopback TCP.",
        "",
        f"Command: `{report['command']}` ({report.get('date', '')}, {report['wall_s']:.0f} s). "
        f"zmq chunks of {cfg['chunk_bytes'] >> 20} MiB, collective buckets of "
        f"{cfg['bucket_bytes'] >> 20} MiB; medians of {cfg['repeats']} publishes after "
        f"{cfg['warmups']} untimed ones. Raw figures: `{cfg['json']}`.",
        "",
        "Publish to loaded: from the learner's `publish` call to the last replica's "
        "tensors loaded into a module of the policy's shapes (the path's "
        "`WeightSource.sync_into` into a stand-in of the HF backend, loading as it does: "
        "in parts when shm follows the write), the replicas already waiting for the "
        f"version when the publish starts, as between batches in a run; with 1 and {many} "
        "replicas. GB/s = replicas x bytes / that time; x = its ratio to memcpy (`copy_` "
        "of the same tensors into warm buffers, measured before and after the paths in "
        'the same run; the median of both is used, both are shown). "replica alone": '
        "the replica's `sync_into` that loaded the version (transfer and load), from its "
        "start or the publish's, whichever is later.",
        "",
        f"| model | GB | memcpy GB/s (before / after) | path | 1 replica: publish to loaded "
        f"| x memcpy | replica alone, x memcpy | {many} replicas: publish to loaded "
        f"(aggregate GB/s) | x memcpy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        for index, (path, p) in enumerate(r["paths"].items()):
            one, lots = p["replicas_1"], p.get(f"replicas_{many}")
            head = (
                [
                    r["model"],
                    f"{r['bytes'] / GB:.2f}",
                    f"{r['memcpy_gbps']:.2f} ({r['memcpy_before_gbps']:.2f} / "
                    f"{r['memcpy_after_gbps']:.2f})",
                ]
                if index == 0
                else ["", "", ""]
            )
            cells = [
                *head,
                path,
                f"{one['loaded_s']:.3f} s ({one['loaded_gbps']:.2f} GB/s)",
                f"**{ratio(r, path, 1):.3f}**",
                f"{ratio(r, path, 1, 'replica_gbps'):.3f}",
            ]
            if lots is None:
                cells += ["not run (memory)", ""]
            else:
                cells += [
                    f"{lots['loaded_s']:.3f} s ({lots['loaded_gbps']:.2f})",
                    f"{ratio(r, path, many):.3f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
        if "gloo_raw_gbps" in r:
            link = r["gloo_raw_gbps"]
            lines.append(
                f"|  |  |  | bare gloo broadcast (the link) | {link:.2f} GB/s "
                f"| {link / r['memcpy_gbps']:.3f} |  |  |  |"
            )
    lines += [
        "",
        "Learner stall per publish (the seconds `publish()` blocks the learner): zmq copies "
        "into its host snapshot; shm and collective (whose sink is the shm one, the "
        "broadcast beside it) write the shared-memory slot (ZeroMQ copies it from there "
        "only when a replica asks it). Cold: the untimed first publishes (fresh memory; "
        "shm's first also sizes the segment); warm: the median of the timed ones, with 1 "
        "replica (with more, the replicas loading beside the publish take the same 2 "
        "cores). Against the memcpy of the policy "
        f"and a training step of the same model (one {cfg['tokens']}-token sequence, forward, "
        "backward, fused AdamW; a small step, so the shares are upper bounds).",
        "",
        "| model | step | memcpy of the policy | path | stall cold | stall warm, 1 replica "
        f"| warm / memcpy | warm / step | stall warm, {many} replicas (/ memcpy) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        for index, (path, p) in enumerate(r["paths"].items()):
            head = (
                [r["model"], f"{r['step_s']:.3f} s", f"{r['memcpy_s']:.3f} s"]
                if index == 0
                else ["", "", ""]
            )
            warm, lots = stall_of(p, 1), stall_of(p, many)
            cells = [
                *head,
                path,
                ", ".join(f"{c:.3f}" for c in p["stalls_cold_s"]) + " s",
                f"{warm:.3f} s",
                f"**{warm / r['memcpy_s']:.2f}**",
                f"{100 * warm / r['step_s']:.1f}%",
                "not run" if lots is None else f"{lots:.3f} s ({lots / r['memcpy_s']:.2f})",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    body = lines + stage_lines(report) + goal_lines(report["results"]) + readings(report)
    return "\n".join(body) + "\n"


def stage_lines(report: dict) -> list[str]:
    """Where one replica's publish-to-loaded time goes, in memcpys of the policy."""
    lines = [
        "",
        "Where the time goes, one replica, in memcpys of the policy (medians; the stages "
        "of the median run need not add up to its total exactly, and shm's overlap: its "
        "replica loads while the learner writes): the learner's `publish`; from the "
        "publish's start to the replica's try that loaded the version; the transfer (zmq: "
        "fetch and checks; shm: mapping and index checks; collective: ask, offer, the "
        "broadcast of the slot's bytes as the learner writes them, straight into the "
        "module's tensors, and the verdict); the load (the copy into the module; shm: "
        "also the waits for the learner's next tensor; collective: none, the bytes land "
        "in the module's tensors).",
        "",
        "| model | path | publish to loaded | publish (stall) | waiting for the version "
        "| transfer | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        unit = r["memcpy_s"]
        for path, p in r["paths"].items():
            one = p["replicas_1"]
            stall = stall_of(p, 1)
            transfer = one["replica_s"] - one["load_s"]
            cells = [r["model"], path, one["loaded_s"], stall, one["waited_s"], transfer]
            cells = cells[:2] + [f"{x / unit:.2f}" for x in [*cells[2:], one["load_s"]]]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def span(values: list[float], fmt: str = ".2f") -> str:
    low, high = min(values), max(values)
    return f"{low:{fmt}}" if f"{low:{fmt}}" == f"{high:{fmt}}" else f"{low:{fmt}} to {high:{fmt}}"


def goal_lines(results: list[dict]) -> list[str]:
    """The issue's goals against the tables, computed so a re-run keeps the text true."""
    lines = ["", "Against the goals of issue 18 (one replica, every model):", ""]
    for path, goal in GOALS.items():
        got = [x for r in results if (x := ratio(r, path, 1)) is not None]
        alone = [x for r in results if (x := ratio(r, path, 1, "replica_gbps")) is not None]
        if not got:
            continue
        verdict = "met" if min(got) >= goal else "NOT met"
        alone_verdict = "met" if min(alone) >= goal else "not met"
        line = (
            f"- {path} >= {goal} of memcpy: publish to loaded {span(got, '.3f')}, "
            f"**{verdict}**; the replica alone {span(alone, '.3f')}, {alone_verdict}"
        )
        links = [r["gloo_raw_gbps"] / r["memcpy_gbps"] for r in results if "gloo_raw_gbps" in r]
        if path == "collective" and links:
            line += f"; a bare gloo broadcast of the same bytes {span(links, '.3f')}"
        lines.append(line + ".")
    for path in PATHS:
        got = [stall_of(r["paths"][path], 1) / r["memcpy_s"] for r in results if path in r["paths"]]
        if got:
            verdict = "met" if max(got) <= STALL_GOAL else "NOT met"
            lines.append(
                f"- {path}: learner stall <= {STALL_GOAL} memcpy of the policy: "
                f"{span(got)}, **{verdict}**."
            )
    return lines


def readings(report: dict) -> list[str]:
    """Why the figures are what they are, with the numbers of this run."""
    results, many = report["results"], report["config"]["replicas"]

    def stage(path: str, key: str) -> str:
        values = []
        for r in results:
            one = r["paths"][path]["replicas_1"]
            if key == "transfer":
                value = one["replica_s"] - one["load_s"]
            elif key == "stall_s":
                value = stall_of(r["paths"][path], 1)
            else:
                value = one[key]
            values.append(value / r["memcpy_s"])
        return span(values)

    lines = ["", "Reading the tables:", ""]
    if all("shm" in r["paths"] for r in results):
        lines.append(
            f"- shm: the replica follows the learner's write (the learner announces the "
            f"layout, then marks its progress in bytes after each tensor and every 8 MiB "
            f"within a large one), so its copy out of the "
            f"slot runs beside the learner's copy into it instead of after it: the load, "
            f"waits for the next tensor included, takes {stage('shm', 'load_s')} memcpy "
            f"against a stall of {stage('shm', 'stall_s')} (mapping and checks "
            f"{stage('shm', 'transfer')}). Both copies share the machine's memory bandwidth "
            f"and its 2 cores, so together they cost more than one memcpy."
        )
        crowded = [x / r["memcpy_s"] for r in results if (x := stall_of(r["paths"]["shm"], many))]
        if crowded:
            lines.append(
                f"- shm with {many} replicas: the learner's stall grows to {span(crowded)} "
                f"memcpy, since {many} followers copy beside the publish on the same 2 cores "
                f"the learner writes with; on a deployment each engine has cores of its own."
            )
    links = [r for r in results if "gloo_raw_gbps" in r and "collective" in r["paths"]]
    if links:
        bare = span([r["memcpy_gbps"] / r["gloo_raw_gbps"] for r in links])
        lines.append(
            f"- collective: the transfer (ask, offer, the gloo broadcast of the slot's "
            f"bytes as the learner writes them, into the module's own tensors, and the "
            f"verdict) takes {stage('collective', 'transfer')} memcpys; a bare gloo "
            f"broadcast of the same bytes between two processes, measured in the same run, "
            f"takes {bare}: that is the link here (loopback TCP, every byte copied through "
            f"the kernel twice), and the path's own overhead is the difference: mostly the "
            f"learner's write, which shares the 2 cores and the memory bandwidth with both "
            f"ends of the broadcast (the first broadcast, 4 MiB, leaves once those bytes are "
            f"written, not once the whole embedding is). The "
            f"replica waits {stage('collective', 'waited_s')} memcpys before its try, and "
            f"loads for {stage('collective', 'load_s')}."
        )
    if all("zmq" in r["paths"] for r in results):
        lines.append(
            f"- zmq: the fetch (chunks through loopback TCP, a crc32 per chunk, tensors "
            f"rebuilt in fresh memory) takes {stage('zmq', 'transfer')} memcpys; it stays the "
            f"path across machines and the last fallback."
        )
    scale = [
        p[f"replicas_{many}"]["loaded_gbps"] / p["replicas_1"]["loaded_gbps"]
        for r in results
        for p in r["paths"].values()
        if f"replicas_{many}" in p
    ]
    if scale:
        lines.append(
            f"- {many} replicas get {span(scale)} times the aggregate of one: the learner and "
            f"the {many} replicas share the same 2 cores here, so the aggregate cannot scale "
            f"with the replicas; on a real deployment each engine has its own."
        )
    return lines


def write_section(body: str) -> None:
    """Replace only the weights section of docs/benchmarks.md."""
    text = DOC.read_text()
    start = text.index(SECTION) + len(SECTION)
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end + 1
    DOC.write_text(text[:start] + "\n\n" + body + ("\n" if end < len(text) else "") + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10M, all paths, 1 and 2 replicas")
    parser.add_argument("--models", default=f"100M,{REAL},{REAL_LORA},500M")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--many-max-bytes",
        type=float,
        default=1.2e9,
        help="models up to this size also run with --replicas replicas (memory)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed publishes per measurement")
    parser.add_argument("--warmups", type=int, default=2, help="untimed publishes (cold) first")
    parser.add_argument("--memcpy-repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per model")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per training step")
    parser.add_argument("--chunk-mib", type=int, default=DEFAULT_CHUNK_BYTES >> 20)
    parser.add_argument("--bucket-mib", type=int, default=64, help="weights.bucket_bytes")
    parser.add_argument("--json", default=None, help="results file (default docs/benchmarks/)")
    parser.add_argument("--no-docs", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the learner")
    parser.add_argument("--render", default=None, help="rewrite the docs from a results file")
    args = parser.parse_args()
    if args.render:
        write_section(markdown(json.loads(Path(args.render).read_text())))
        return
    torch.set_num_threads(args.threads)
    if args.quick:
        args.models, args.replicas, args.steps, args.repeats = "10M", 2, 1, 2
        args.warmups, args.memcpy_repeats = 1, 3
    results_dir = Path(tempfile.gettempdir()) if args.quick else ROOT / "docs" / "benchmarks"
    json_path = Path(args.json) if args.json else results_dir / "weights_publish.json"
    began = time.perf_counter()
    report = {
        "command": " ".join(["python", "benchmarks/weights_publish.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "config": {
            "chunk_bytes": args.chunk_mib << 20,
            "bucket_bytes": args.bucket_mib << 20,
            "repeats": args.repeats,
            "warmups": args.warmups,
            "tokens": args.tokens,
            "replicas": args.replicas,
            "many_max_bytes": args.many_max_bytes,
            "json": str(
                json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path
            ),
        },
        "results": [],
    }
    replicas = Replicas(args.replicas)
    version = 0
    try:
        for name in args.models.split(","):
            result, version = run_model(name, args, replicas, version)
            report["results"].append(result)
    finally:
        replicas.close()
    report["wall_s"] = time.perf_counter() - began
    report["machine"]["loadavg_end"] = common.loadavg()
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    print("\n" + table)
    if not args.quick and not args.no_docs:
        write_section(table)
        print(f"wrote {DOC.relative_to(ROOT)} and {json_path}")


if __name__ == "__main__":
    main()
