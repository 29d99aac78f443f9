"""LoRA against full fine-tuning on the real model: the learner's step, its memory, and
what each weight sync and checkpoint moves, on the same batch, side by side in one run.

    bash scripts/setup.sh dev && bash scripts/smollm2.sh
    .venv/bin/python benchmarks/lora_vs_full.py          # about 5 minutes on 2 cores

SmolLM2-135M-Instruct (fp32) with ``configs/smollm2_arithmetic.yaml``'s learner settings,
one rank on ``--threads`` torch threads (the learner's own core in a run), a batch shaped
like the arithmetic task's (4 prompts of 40 tokens x 8 samples of 32 tokens, the samples
of a prompt sharing it). Each mode runs in a process of its own (its peak resident
memory is its own), the modes alternating for ``--rounds``. Reported per mode: the
median seconds of a learner step (proximal pass, forward, backward, optimizer) after a
warm-up step, learner tokens/s, peak resident memory, trainable parameters and their
optimizer state, the bytes one weight sync publishes, and the bytes of one checkpoint.
With ``model.lora`` a sync moves what ``model.lora.publish`` says (``adapter``, the
default: the adapters alone); the adapters' bytes are reported beside it. How long each
path takes to move them: ``weights_publish.py --models SmolLM2-135M,SmolLM2-LoRA16``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

REPO = common.REPO
CONFIG = REPO / "configs" / "smollm2_arithmetic.yaml"
PROMPT_TOKENS, RESPONSE_TOKENS = 40, 32
MODES = {"full": [], "lora": ["model.lora.rank=16", "model.lora.alpha=32"]}


def arithmetic_shaped_batch(prompts: int, group: int, vocab: int):
    """``prompts`` groups of ``group`` samples, each group's prompt shared, random
    response tokens, rewards and behaviour log-probs, made at version 0."""
    import torch

    from asyncrl.learner.batch import TrainBatch

    generator = torch.Generator().manual_seed(0)
    rows, width = prompts * group, PROMPT_TOKENS + RESPONSE_TOKENS
    prompt = torch.randint(3, vocab, (prompts, PROMPT_TOKENS), generator=generator)
    response = torch.randint(3, vocab, (rows, RESPONSE_TOKENS), generator=generator)
    loss_mask = torch.zeros(rows, width - 1)
    loss_mask[:, PROMPT_TOKENS - 1 :] = 1
    return TrainBatch(
        input_ids=torch.cat([prompt.repeat_interleave(group, 0), response], dim=1),
        attention_mask=torch.ones(rows, width, dtype=torch.long),
        behavior_logprobs=-torch.rand(rows, width - 1, generator=generator) * 3,
        loss_mask=loss_mask,
        token_versions=torch.where(loss_mask.bool(), 0, -1),
        rewards=torch.rand(rows, generator=generator),
        group_ids=torch.arange(rows) // group,
        versions=torch.zeros(rows, dtype=torch.long),
        response_lengths=torch.full((rows,), RESPONSE_TOKENS),
    )


def measure(mode: str, steps: int, threads: int) -> dict:
    """One mode in this process: the figures of :func:`main`'s table."""
    import torch

    from asyncrl.config import load_config
    from asyncrl.generation import lora
    from asyncrl.learner import distributed
    from asyncrl.learner.policy import Learner

    torch.set_num_threads(threads)
    model = f"model.name_or_path={REPO / 'models/SmolLM2-135M-Instruct'}"
    config = load_config(CONFIG, [model, *MODES[mode]])
    ranks = distributed.init("cpu")
    try:
        learner = Learner(config, ranks)
        batch = arithmetic_shaped_batch(
            config.algorithm.prompts_per_step, config.algorithm.group_size, len(learner.tokenizer)
        )
        step_s = []
        for step in range(steps + 1):  # the first is a warm-up
            started = time.perf_counter()
            metrics = learner.train_step(batch)
            if step:
                step_s.append(time.perf_counter() - started)
        trainable = [p for group in learner.optimizer.param_groups for p in group["params"]]
        optimizer_bytes = sum(
            t.numel() * t.element_size()
            for state in learner.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t) and t.dim() > 0
        )
        published = sum(t.numel() * t.element_size() for _, t in learner.published_tensors())
        adapters = sum(
            t.numel() * t.element_size()
            for name, t in learner.model.state_dict().items()
            if lora.is_adapter(name)
        )
        with tempfile.TemporaryDirectory() as folder:
            assert learner.save_checkpoint(Path(folder) / "step")
            checkpoint = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        tokens = int(batch.loss_mask.sum())
        median = statistics.median(step_s)
        return {
            "mode": mode,
            "step_s": step_s,
            "median_step_s": median,
            "trained_tokens_per_s": tokens / median,
            "loss_policy": metrics["loss_policy"],
            "trainable_parameters": sum(p.numel() for p in trainable),
            "optimizer_state_bytes": optimizer_bytes,
            "published_bytes": published,
            "adapter_bytes": adapters,
            "checkpoint_bytes": checkpoint,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    finally:
        distributed.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "docs/benchmarks/lora_vs_full.json")
    parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.steps, args.threads)))
        return
    if not (REPO / "models/SmolLM2-135M-Instruct").is_dir():
        raise SystemExit("models/SmolLM2-135M-Instruct is missing: bash scripts/smollm2.sh")
    report = {
        "machine": common.machine_info(),
        "commit": common.git_commit(),
        "threads": args.threads,
        "loadavg_start": common.loadavg(),
        "runs": [],
    }
    for number in range(args.rounds):
        order = ("full", "lora") if number % 2 == 0 else ("lora", "full")
        for mode in order:
            command = [sys.executable, __file__, f"--child={mode}", f"--steps={args.steps}"]
            command.append(f"--threads={args.threads}")
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            report["runs"].append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(f"round {number + 1}, {mode}: {report['runs'][-1]['median_step_s']:.2f} s/step")
    report["loadavg_end"] = common.loadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))


def markdown(report: dict) -> str:
    mib = 2**20
    lines = [
        "| mode | step (s, median per round) | trained tokens/s | peak RSS (MiB) | trainable "
        "parameters | optimizer state (MiB) | published per sync (MiB) | adapters (MiB) | "
        "checkpoint (MiB) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        runs = [run for run in report["runs"] if run["mode"] == mode]
        last = runs[-1]
        steps = ", ".join(f"{run['median_step_s']:.2f}" for run in runs)
        lines.append(
            f"| {mode} | {steps} | "
            f"{statistics.median(r['trained_tokens_per_s'] for r in runs):.0f} | "
            f"{max(r['peak_rss_bytes'] for r in runs) / mib:.0f} | "
            f"{last['trainable_parameters']:,} | {last['optimizer_state_bytes'] / mib:.1f} | "
            f"{last['published_bytes'] / mib:.1f} | {last['adapter_bytes'] / mib:.2f} | "
            f"{last['checkpoint_bytes'] / mib:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
