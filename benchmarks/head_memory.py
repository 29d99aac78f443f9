"""The learner's LM head whole against a chunk at a time: peak memory and tokens/s of a
learner step on real models, the same batch, side by side in one run.

    bash scripts/setup.sh dev && bash scripts/smollm2.sh && bash scripts/gemma3.sh
    .venv/bin/python benchmarks/head_memory.py        # about 10 minutes on 2 cores

Models: SmolLM2-135M-Instruct (49k vocabulary) and Gemma-3-270M (262k), fp32, one learner
rank on ``--threads`` threads, ``configs/smollm2_arithmetic.yaml``'s learner settings. The
batch: 4 prompts of 40 tokens x 8 samples of 32 response tokens (1,024 trained tokens),
each group's prompt shared. Modes: ``whole``, every trained token's logits at once
(``[N, V]`` fp32 and their gradient, as the learner did before), and ``chunked``, the
head a chunk at a time (``asyncrl.learner.packing.CHUNKED_HEAD``, the default now). Each
(model, mode) runs in a process of its own, so its peak resident memory is its own;
modes alternate for ``--rounds``. Reported: the median learner step after a warm-up
(proximal pass, forward, backward, AdamW), trained tokens/s and peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
from lora_vs_full import arithmetic_shaped_batch

REPO = common.REPO
CONFIG = REPO / "configs" / "smollm2_arithmetic.yaml"
MODELS = {"SmolLM2-135M": "models/SmolLM2-135M-Instruct", "Gemma-3-270M": "models/gemma-3-270m"}
MODES = ("whole", "chunked")


def measure(model: str, mode: str, steps: int, threads: int) -> dict:
    import torch

    from asyncrl.config import load_config
    from asyncrl.learner import distributed, packing
    from asyncrl.learner.policy import Learner

    torch.set_num_threads(threads)
    packing.CHUNKED_HEAD = mode == "chunked"
    config = load_config(CONFIG, [f"model.name_or_path={REPO / MODELS[model]}"])
    ranks = distributed.init("cpu")
    try:
        learner = Learner(config, ranks)
        vocab = learner.policy_config.vocab_size
        batch = arithmetic_shaped_batch(
            config.algorithm.prompts_per_step, config.algorithm.group_size, vocab
        )
        step_s = []
        for step in range(steps + 1):  # the first is a warm-up
            started = time.perf_counter()
            metrics = learner.train_step(batch)
            if step:
                step_s.append(time.perf_counter() - started)
        median = statistics.median(step_s)
        return {
            "model": model,
            "mode": mode,
            "vocab": vocab,
            "step_s": step_s,
            "median_step_s": median,
            "trained_tokens_per_s": int(batch.loss_mask.sum()) / median,
            "loss_policy": metrics["loss_policy"],
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    finally:
        distributed.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/head_memory.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model, mode = args.child.split(":")
        print(json.dumps(measure(model, mode, args.steps, args.threads)))
        return
    models = args.models.split(",")
    for model in models:
        if not (REPO / MODELS[model]).is_dir():
            raise SystemExit(f"{MODELS[model]} is missing (scripts/smollm2.sh, scripts/gemma3.sh)")
    report = {"machine": common.machine_info(), "commit": common.git_commit(), "runs": []}
    report["threads"], report["loadavg_start"] = args.threads, common.loadavg()
    for number in range(args.rounds):
        for model in models:
            for mode in MODES if number % 2 == 0 else MODES[::-1]:
                command = [sys.executable, __file__, f"--child={model}:{mode}"]
                command += [f"--steps={args.steps}", f"--threads={args.threads}"]
                result = subprocess.run(command, capture_output=True, text=True, check=True)
                run = json.loads(result.stdout.strip().splitlines()[-1])
                report["runs"].append(run)
                print(f"round {number + 1}, {model} {mode}: {run['median_step_s']:.2f} s/step, "
                      f"peak {run['peak_rss_bytes'] / 2**30:.2f} GiB", flush=True)  # fmt: skip
    report["loadavg_end"] = common.loadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = [
        "| model (vocabulary) | head | step (s, per round) | trained tokens/s | peak RSS (GiB) |",
        "|---|---|---|---:|---:|",
    ]
    for model in dict.fromkeys(run["model"] for run in report["runs"]):
        for mode in MODES:
            runs = [r for r in report["runs"] if r["model"] == model and r["mode"] == mode]
            steps = ", ".join(f"{r['median_step_s']:.2f}" for r in runs)
            lines.append(
                f"| {model} ({runs[0]['vocab']:,}) | {mode} | {steps} | "
                f"{statistics.median(r['trained_tokens_per_s'] for r in runs):.0f} | "
                f"{max(r['peak_rss_bytes'] for r in runs) / 2**30:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
