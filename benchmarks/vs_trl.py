"""asyncrl against TRL's GRPOTrainer on the same machine, model, data, reward and settings.

    bash scripts/setup.sh dev,bench && bash scripts/smollm2.sh
    .venv/bin/python examples/arithmetic/data.py
    .venv/bin/python benchmarks/vs_trl.py --steps 40 --seeds 0,1    # about 2 hours on 2 cores
    .venv/bin/python benchmarks/vs_trl.py --render docs/benchmarks/vs_trl.json  # or several

What a user choosing between the two would compare: SmolLM2-135M-Instruct (fp32)
learning the arithmetic task with ``configs/smollm2_arithmetic.yaml``'s settings
(4 prompts x 8 samples per optimizer step, lr 2e-5 constant, temperature 0.7,
32 new tokens, clip 0.2, no KL, one update per batch), N optimizer steps each,
for each seed one after the other (the order alternates between seeds), then
each final policy through one evaluator (``vs_trl_workers.py eval``: 64 held-out
prompts x 8 samples).

- TRL: ``GRPOTrainer`` in one process with 2 torch threads (``vs_trl_workers.py
  trl``; every setting and where TRL's default was changed is in ``trl_config``).
- asyncrl: ``asyncrl launch configs/smollm2_arithmetic.yaml`` as shipped
  (asynchronous, ``max_staleness: 1``, one generator, the roles pinned to cores)
  with its in-run evaluation and checkpoints switched off, since TRL does neither.

Reported per run: seconds per optimizer step (median over steps ``--from-step``
to N, and over all), the time from the first step's start to step N and the
whole command's wall time, learner tokens/s (TRL: the batch's tokens over the
step minus its generation and scoring; asyncrl: ``learner_tokens_per_s``, the
same tokens over the update), training reward by window of 10 steps, the final
eval reward, and the machine with its load before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

REPO = common.REPO
WORKERS = Path(__file__).with_name("vs_trl_workers.py")
CONFIG = REPO / "configs" / "smollm2_arithmetic.yaml"
ASYNCRL_OVERRIDES = [
    "eval.every_steps=0",
    "eval.before_training=false",
    "eval.at_end=false",
    "learner.checkpoint_every=0",
]
"""The shipped config minus the work TRL does not do: in-run evaluation and checkpoints."""
WINDOW = 10


def run_trl(seed: int, steps: int, out: Path) -> dict:
    started = time.monotonic()
    load = common.loadavg()[0]
    command = [sys.executable, str(WORKERS), "trl", f"--seed={seed}", f"--steps={steps}"]
    log = out.with_suffix(".log")
    with log.open("w") as log_file:
        subprocess.run(
            [*command, f"--out={out}"],
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            check=True,
        )
    per_step = json.loads((out / "steps.json").read_text())
    return {
        "tool": "trl",
        "seed": seed,
        "command_s": time.monotonic() - started,
        "loadavg": [load, common.loadavg()[0]],
        "step_s": [s["step_s"] for s in per_step],
        "to_last_step_s": per_step[-1]["time_s"],
        "learner_tokens_per_s": [s["tokens"] / (s["step_s"] - s["generate_s"]) for s in per_step],
        "generate_share": [s["generate_s"] / s["step_s"] for s in per_step],
        "reward_mean": [s.get("reward_mean") for s in per_step],
        "policy": str(out / "final"),
    }


def run_asyncrl(seed: int, steps: int, out: Path) -> dict:
    overrides = [*ASYNCRL_OVERRIDES, f"run.total_steps={steps}", f"run.seed={seed}"]
    result = common.launch(CONFIG, overrides, out, timeout_s=4 * 3600)
    metrics = result.metrics
    times = [m["time_s"] for m in metrics]  # from the learner's start, model loaded
    return {
        "tool": "asyncrl",
        "seed": seed,
        "command_s": result.seconds,
        "loadavg": list(result.loadavg),
        "step_s": [times[0], *(b - a for a, b in itertools.pairwise(times))],
        "to_last_step_s": times[-1],
        "learner_tokens_per_s": [m["learner_tokens_per_s"] for m in metrics],
        "learner_wait_frac": metrics[-1]["learner_wait_frac"],
        "update_s": [m["time_update_s"] for m in metrics],
        "reward_mean": [m["reward_mean"] for m in metrics],
        "policy": str(out / "final"),
    }


def pinning(steps: int, work_dir: Path) -> dict:
    """asyncrl's learner with its roles pinned to cores (the default), then with the
    placement left to the operating system: one run each."""
    out = {}
    for setting in ("auto", "false"):
        overrides = [*ASYNCRL_OVERRIDES, f"run.total_steps={steps}", f"cluster.pin_cores={setting}"]
        result = common.launch(CONFIG, overrides, work_dir / f"pin-{setting}", timeout_s=3600)
        steady = result.metrics[1:]  # the first step waits for the first batch
        out[setting] = {
            "update_s": statistics.median(m["time_update_s"] for m in steady),
            "learner_tokens_per_s": statistics.median(m["learner_tokens_per_s"] for m in steady),
            "step_s": (steady[-1]["time_s"] - result.metrics[0]["time_s"]) / len(steady),
        }
    return out


def evaluate(policy: str, out: Path) -> dict:
    command = [sys.executable, str(WORKERS), "eval", f"--policy={policy}", f"--out={out}"]
    subprocess.run(command, cwd=REPO, check=True, capture_output=True)
    return json.loads(out.read_text())


def summarise(run: dict, from_step: int) -> dict:
    steady = run["step_s"][from_step - 1 :]
    rewards = [r for r in run["reward_mean"] if r is not None]
    windows = [rewards[i : i + WINDOW] for i in range(0, len(rewards), WINDOW)]
    return {
        "median_step_s": statistics.median(steady),
        "median_step_s_all": statistics.median(run["step_s"]),
        "to_last_step_s": run["to_last_step_s"],
        "command_s": run["command_s"],
        "learner_tokens_per_s": statistics.median(run["learner_tokens_per_s"][from_step - 1 :]),
        "reward_by_window": [statistics.fmean(w) for w in windows],
    }


def bound_by(runs: list[dict]) -> str:
    """What each step waits on: TRL's generation against its training, in turn; asyncrl's
    learner waiting for data (the generator bounds it) or not (the learner does)."""
    if runs[0]["tool"] == "trl":
        share = statistics.fmean(statistics.fmean(run["generate_share"]) for run in runs)
        return f"in turn: generating and scoring {share:.0%} of a step, training the rest"
    wait = statistics.fmean(run["learner_wait_frac"] for run in runs)
    side = "the generator (the learner waits)" if wait > 0.1 else "the learner"
    return f"{side}: the learner waits for data {wait:.0%} of the time"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--from-step", type=int, default=16, help="steady state from this step")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "vs_trl")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "vs_trl.json")
    parser.add_argument(
        "--render", type=Path, nargs="+", help="print the tables of earlier JSONs, runs merged"
    )
    parser.add_argument(
        "--pinning-steps", type=int, default=15, help="asyncrl pinned and not, this many steps"
    )
    args = parser.parse_args(argv)
    if args.render:
        print(markdown(merged([json.loads(path.read_text()) for path in args.render])))
        return
    for needed in (CONFIG, REPO / "models/SmolLM2-135M-Instruct", REPO / "data/arithmetic"):
        if not needed.exists():
            raise SystemExit(f"{needed} is missing: see this script's docstring for set-up")
    report = {
        "machine": common.machine_info() | {"loadavg_start": common.loadavg()},
        "commit": common.git_commit(),
        "steps": args.steps,
        "from_step": args.from_step,
        "runs": [],
    }
    args.work_dir.mkdir(parents=True, exist_ok=True)
    seeds = [int(seed) for seed in args.seeds.split(",") if seed]  # --seeds= : pinning only
    if seeds:
        report["untrained"] = evaluate(
            str(REPO / "models/SmolLM2-135M-Instruct"), args.work_dir / "eval-untrained.json"
        )
    for number, seed in enumerate(seeds):
        order = ("trl", "asyncrl") if number % 2 == 0 else ("asyncrl", "trl")
        for tool in order:
            out = args.work_dir / f"{tool}-seed{seed}"
            print(f"[{time.strftime('%H:%M:%S')}] {tool}, seed {seed}", flush=True)
            run = (run_trl if tool == "trl" else run_asyncrl)(seed, args.steps, out)
            run["eval"] = evaluate(run["policy"], args.work_dir / f"eval-{tool}-seed{seed}.json")
            run["summary"] = summarise(run, args.from_step)
            report["runs"].append(run)
            report["machine"]["loadavg_end"] = common.loadavg()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    if args.pinning_steps:
        print(f"[{time.strftime('%H:%M:%S')}] asyncrl pinned and not", flush=True)
        report["pinning"] = pinning(args.pinning_steps, args.work_dir)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))


def merged(reports: list[dict]) -> dict:
    """One report of several runs' (more seeds run later): every run, the commits named;
    the machine, settings and untrained eval of the first."""
    commits = dict.fromkeys(report["commit"] for report in reports)
    runs = [run for report in reports for run in report["runs"]]
    return reports[0] | {"commit": ", ".join(commits), "runs": runs}


def markdown(report: dict) -> str:
    machine = report["machine"]
    lines = [
        f"{machine['cpu']}, {machine['nproc']} cores; load {machine.get('loadavg_start')} at the "
        f"start; commit {report['commit']}; {report['steps']} steps, steady from step "
        f"{report['from_step']}",
        "",
        "| run | s/step (steady) | s/step (all) | first step to last (s) | command (s) | "
        "learner tokens/s | train reward by 10 steps | eval reward |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for run in report["runs"]:
        s, e = run["summary"], run["eval"]
        windows = " / ".join(f"{r:.3f}" for r in s["reward_by_window"])
        lines.append(
            f"| {run['tool']} seed {run['seed']} | {s['median_step_s']:.1f} | "
            f"{s['median_step_s_all']:.1f} | {s['to_last_step_s']:.0f} | {s['command_s']:.0f} | "
            f"{s['learner_tokens_per_s']:.0f} | {windows} | "
            f"{e['reward_mean']:.3f} ± {e['reward_stderr']:.3f} |"
        )
    untrained = report.get("untrained")
    if untrained:
        lines.append(
            f"| untrained model | | | | | | | {untrained['reward_mean']:.3f} ± "
            f"{untrained['reward_stderr']:.3f} |"
        )
    by_tool: dict[str, list[dict]] = {}
    for run in report["runs"]:
        by_tool.setdefault(run["tool"], []).append(run)
    to_last = {
        tool: statistics.fmean(run["summary"]["to_last_step_s"] for run in runs)
        for tool, runs in by_tool.items()
    }
    lines += ["", "| tool | seeds | mean eval reward | mean time to the last step (s) | bound by |"]
    lines += ["|---|---:|---:|---:|---|"]
    for tool in ("trl", "asyncrl"):
        if runs := by_tool.get(tool):
            evals = statistics.fmean(run["eval"]["reward_mean"] for run in runs)
            lines.append(
                f"| {tool} | {len(runs)} | {evals:.3f} | {to_last[tool]:.0f} | {bound_by(runs)} |"
            )
    if {"trl", "asyncrl"} <= by_tool.keys():
        ratio = to_last["trl"] / to_last["asyncrl"]
        lines += ["", f"asyncrl reaches step {report['steps']} {ratio:.2f}x as fast as TRL "]
        lines[-1] += "(mean over seeds, first step's start to the last step)"
    if "pinning" in report:
        lines += ["", "| asyncrl, roles | learner update (s) | learner tokens/s | s/step |"]
        lines += ["|---|---:|---:|---:|"]
        for setting, name in (("auto", "pinned to cores"), ("false", "placed by the OS")):
            run = report["pinning"][setting]
            lines.append(
                f"| {name} | {run['update_s']:.2f} | {run['learner_tokens_per_s']:.0f} | "
                f"{run['step_s']:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
