"""Learning against staleness: buffer.max_staleness x correction variant x seeds.

    nice .venv/bin/python benchmarks/staleness_sweep.py           # 45 launches, ~30 minutes
    .venv/bin/python benchmarks/staleness_sweep.py --staleness 0 4 8 \
        --corrections tis icepop seq-tis m2po --out docs/benchmarks/staleness_corrections.json
    .venv/bin/python benchmarks/staleness_sweep.py --quick         # 2 launches, a smoke test
    .venv/bin/python benchmarks/staleness_sweep.py --plot-only     # redraw from the JSON

Every launch is ``asyncrl launch CONFIG`` with the sweep's shared overrides plus
``buffer.max_staleness=K run.seed=S`` and the overrides of the correction variant
(:data:`VARIANTS`: a name for one or more ``algorithm.*`` settings). Weights are
published every version (``learner.sync_interval=1``) and two generator
replicas outpace the learner, so the batch's staleness comes from how far
ahead admission control lets them run (up to K batches); the staleness each
run really got is read back from its metrics and reported. Each finished run
is appended to the JSON at once, so an interrupted sweep continues where it
stopped (``--resume``).

Outputs: the JSON (per run: settings, summary, the reward / samples / time /
staleness curve of every step) and three PNGs: reward against samples and
against wall time per correction, and at the largest staleness the corrections
against the on-policy run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # benchmarks/ is not a package: found on sys.path

DOCS = common.REPO / "docs" / "benchmarks"
DEFAULT_OUT = DOCS / "staleness_sweep.json"
SHARED = [
    "algorithm.prompts_per_step=16",
    "learner.lr=1e-3",
    "learner.sync_interval=1",
    "generators.replicas=2",
    "tracking.aim=false",
]
"""The quickstart made short: 128 samples per step at twice its learning rate."""
SMOOTH = 10
"""Steps in the trailing mean of the reward used for curves and targets."""
VARIANTS: dict[str, list[str]] = {
    "none": ["algorithm.correction=none"],
    "tis": ["algorithm.correction=tis"],
    "decoupled": ["algorithm.correction=decoupled"],
    "icepop": ["algorithm.correction=icepop"],
    "seq-tis": ["algorithm.correction=tis", "algorithm.correction_level=sequence"],
    "geo-tis": ["algorithm.correction=tis", "algorithm.correction_level=geometric"],
    "m2po": ["algorithm.correction=tis", "algorithm.m2po_threshold=0.04"],
}
"""Correction variants by name: the behavior weight and what else corrects stale tokens."""
CORRECTION_COLORS = {
    "none": "tab:red",
    "tis": "tab:blue",
    "decoupled": "tab:green",
    "icepop": "tab:orange",
    "seq-tis": "tab:purple",
    "geo-tis": "tab:brown",
    "m2po": "tab:cyan",
}


def run_key(staleness: int, correction: str, seed: int) -> str:
    return f"k{staleness}-{correction}-s{seed}"


def run_once(args: argparse.Namespace, staleness: int, correction: str, seed: int) -> dict:
    overrides = [
        *SHARED,
        f"run.total_steps={args.steps}",
        *args.set,
        f"buffer.max_staleness={staleness}",
        *VARIANTS[correction],
        f"run.seed={seed}",
    ]
    run_dir = args.work_dir / run_key(staleness, correction, seed)
    result = common.launch(args.config, overrides, run_dir, nice=args.nice)
    metrics = result.metrics
    steady = metrics[len(metrics) // 5 :]
    return {
        "key": run_key(staleness, correction, seed),
        "staleness": staleness,
        "correction": correction,
        "overrides": VARIANTS[correction],
        "code": common.git_commit(),
        "seed": seed,
        "launch_s": round(result.seconds, 2),
        "loadavg_1min": list(result.loadavg),
        "staleness_mean": statistics.fmean(m["staleness_mean"] for m in steady),
        "staleness_max": max(m["staleness_max"] for m in metrics),
        "evicted_frac": metrics[-1].get("buffer_evicted_frac", 0.0),
        "importance_weight_max": max(m.get("importance_weight_max", 1.0) for m in metrics),
        "learner_wait_frac": metrics[-1]["learner_wait_frac"],
        "curve": {
            "samples": [int(m["samples_total"]) for m in metrics],
            "time_s": [round(m["time_s"], 2) for m in metrics],
            "reward": [round(m["reward_mean"], 4) for m in metrics],
            "staleness": [round(m["staleness_mean"], 2) for m in metrics],
        },
    }


# ----------------------------------------------------------------- analysis


def reach(run: dict, target: float) -> tuple[float | None, float | None]:
    """(samples, seconds) at which the run's smoothed reward first reaches ``target``."""
    curve = run["curve"]
    samples = common.first_reaching(curve["samples"], curve["reward"], target, SMOOTH)
    seconds = common.first_reaching(curve["time_s"], curve["reward"], target, SMOOTH)
    return samples, seconds


def table(runs: list[dict], targets: list[float]) -> list[dict]:
    """One row per (staleness, correction): means over seeds, and the targets reached."""
    rows = []
    cells = sorted({(r["staleness"], r["correction"]) for r in runs})
    for staleness, correction in cells:
        group = [r for r in runs if (r["staleness"], r["correction"]) == (staleness, correction)]
        final = [statistics.fmean(r["curve"]["reward"][-20:]) for r in group]
        row = {
            "staleness": staleness,
            "correction": correction,
            "seeds": len(group),
            "staleness_mean": statistics.fmean(r["staleness_mean"] for r in group),
            "evicted_frac": statistics.fmean(r["evicted_frac"] for r in group),
            "final_reward_mean": statistics.fmean(final),
            "final_reward_std": statistics.stdev(final) if len(final) > 1 else 0.0,
            "train_s_mean": statistics.fmean(r["curve"]["time_s"][-1] for r in group),
            "targets": {},
        }
        for target in targets:
            hits = [reach(r, target) for r in group]
            reached = [h for h in hits if h[0] is not None]
            row["targets"][str(target)] = {
                "reached": len(reached),
                "samples_median": statistics.median(h[0] for h in reached) if reached else None,
                "seconds_median": statistics.median(h[1] for h in reached) if reached else None,
            }
        rows.append(row)
    return rows


def mean_curve(group: list[dict], x: str) -> tuple[list[float], list[float], list[float]]:
    """Per step across seeds: mean x, mean smoothed reward, and its standard error."""
    steps = min(len(r["curve"]["reward"]) for r in group)
    smoothed = [common.moving_average(r["curve"]["reward"], SMOOTH)[:steps] for r in group]
    xs = [statistics.fmean(r["curve"][x][i] for r in group) for i in range(steps)]
    ys = [statistics.fmean(s[i] for s in smoothed) for i in range(steps)]
    if len(group) > 1:
        errs = [statistics.stdev(s[i] for s in smoothed) / len(group) ** 0.5 for i in range(steps)]
    else:
        errs = [0.0] * steps
    return xs, ys, errs


def band(ax, xs: list[float], ys: list[float], errs: list[float], color, alpha: float) -> None:
    """Shade one standard error either side of a mean curve."""
    low = [y - e for y, e in zip(ys, errs, strict=True)]
    high = [y + e for y, e in zip(ys, errs, strict=True)]
    ax.fill_between(xs, low, high, color=color, alpha=alpha, linewidth=0)


def plot(runs: list[dict], out: Path, title: str) -> list[Path]:
    """The PNGs beside ``out``, named after its stem (``staleness_sweep_samples.png`` ...)."""
    out_dir, stem = out.parent, out.stem
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit("plotting needs matplotlib: .venv/bin/pip install matplotlib") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({r["staleness"] for r in runs})
    corrections = [c for c in VARIANTS if any(r["correction"] == c for r in runs)]
    colors = plt.get_cmap("viridis")
    color = {k: colors(i / max(1, len(ks) - 1) * 0.9) for i, k in enumerate(ks)}
    written = []
    for x, label, name in (
        ("samples", "samples trained on", f"{stem}_samples.png"),
        ("time_s", "seconds since the learner started", f"{stem}_time.png"),
    ):
        fig, axes = plt.subplots(
            1, len(corrections), figsize=(5 * len(corrections), 4), sharey=True
        )
        axes = [axes] if len(corrections) == 1 else list(axes)
        for ax, correction in zip(axes, corrections, strict=True):
            for k in ks:
                group = [r for r in runs if r["staleness"] == k and r["correction"] == correction]
                if not group:
                    continue
                xs, ys, errs = mean_curve(group, x)
                stale = statistics.fmean(r["staleness_mean"] for r in group)
                ax.plot(xs, ys, color=color[k], label=f"k={k} (staleness {stale:.1f})")
                band(ax, xs, ys, errs, color[k], 0.2)
            ax.set_title(f"correction = {correction}")
            ax.set_xlabel(label)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
        axes[0].set_ylabel(f"reward (trailing mean of {SMOOTH} steps)")
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        written.append(out_dir / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    largest = [k for k in ks if k > 0][-2:]  # the two largest staleness bounds
    if largest and 0 in ks:
        fig, axes = plt.subplots(1, len(largest), figsize=(5.5 * len(largest), 4), sharey=True)
        axes = [axes] if len(largest) == 1 else list(axes)
        for ax, k in zip(axes, largest, strict=True):
            on_policy = [r for r in runs if r["staleness"] == 0]
            xs, ys, errs = mean_curve(on_policy, "samples")
            ax.plot(xs, ys, color="black", label="k=0, on-policy (all corrections)")
            band(ax, xs, ys, errs, "black", 0.12)
            for correction in corrections:
                style = CORRECTION_COLORS[correction]
                group = [r for r in runs if r["staleness"] == k and r["correction"] == correction]
                if not group:
                    continue
                xs, ys, errs = mean_curve(group, "samples")
                ax.plot(xs, ys, color=style, label=f"k={k}, {correction}")
                band(ax, xs, ys, errs, style, 0.2)
            ax.set_title(f"max_staleness = {k} against on-policy")
            ax.set_xlabel("samples trained on")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
        axes[0].set_ylabel(f"reward (trailing mean of {SMOOTH} steps)")
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        written.append(out_dir / f"{stem}_corrections.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def print_table(rows: list[dict], targets: list[float]) -> None:
    head = "| k | correction | seeds | staleness mean | evicted | final reward | train s |"
    head += "".join(f" reach {t}: samples / s (n) |" for t in targets)
    print(head)
    print("|" + "---:|" * (7 + len(targets)))
    for row in rows:
        line = (
            f"| {row['staleness']} | {row['correction']} | {row['seeds']} "
            f"| {row['staleness_mean']:.2f} | {row['evicted_frac']:.3f} "
            f"| {row['final_reward_mean']:.3f} ± {row['final_reward_std']:.3f} "
            f"| {row['train_s_mean']:.1f} |"
        )
        for target in targets:
            hit = row["targets"][str(target)]
            if hit["reached"]:
                line += (
                    f" {hit['samples_median']:,.0f} / {hit['seconds_median']:.1f}"
                    f" ({hit['reached']}/{row['seeds']}) |"
                )
            else:
                line += f" not reached (0/{row['seeds']}) |"
        print(line)


# --------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=common.REPO / "configs/quickstart.yaml")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    parser.add_argument(
        "--corrections", nargs="+", choices=list(VARIANTS), default=["none", "tis", "decoupled"]
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=300, help="run.total_steps of each launch")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.8])
    parser.add_argument("--set", action="append", default=[], help="extra key=value override")
    parser.add_argument("--nice", type=int, default=10, help="run the launches under nice -n")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/asyncrl-bench/staleness"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--resume", action="store_true", help="keep the runs already in --out")
    parser.add_argument("--plot-only", action="store_true", help="redraw from --out, run nothing")
    parser.add_argument("--quick", action="store_true", help="k in {0, 4}, tis, 1 seed, 40 steps")
    args = parser.parse_args()
    args.config = args.config.resolve()
    if args.quick:
        args.staleness, args.corrections, args.seeds, args.steps = [0, 4], ["tis"], [1], 40

    if args.plot_only or args.resume:
        report = json.loads(args.out.read_text())
    else:
        report = {
            "machine": common.machine_info() | {"loadavg_start": common.loadavg()},
            "command": " ".join(["python", "benchmarks/staleness_sweep.py", *sys.argv[1:]]),
            "settings": {
                "config": str(args.config.relative_to(common.REPO)),
                "shared_overrides": [*SHARED, f"run.total_steps={args.steps}", *args.set],
                "nice": args.nice,
                "smooth_steps": SMOOTH,
            },
            "runs": [],
        }
    if not args.plot_only:
        started = time.monotonic()
        invocation = {
            "command": " ".join(["python", "benchmarks/staleness_sweep.py", *sys.argv[1:]]),
            "loadavg_start": common.loadavg(),
        }
        done = {r["key"] for r in report["runs"]}
        for seed in args.seeds:  # seeds outermost: a cut-short sweep still has whole seeds
            for staleness in args.staleness:
                for correction in args.corrections:
                    if run_key(staleness, correction, seed) in done:
                        continue
                    run = run_once(args, staleness, correction, seed)
                    report["runs"].append(run)
                    print(
                        f"{run['key']:18s} staleness {run['staleness_mean']:.2f} "
                        f"final {statistics.fmean(run['curve']['reward'][-20:]):.3f} "
                        f"({run['launch_s']:.0f} s, load {common.loadavg()[0]})",
                        flush=True,
                    )
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(report) + "\n")
        invocation |= {"loadavg_end": common.loadavg(), "seconds": time.monotonic() - started}
        report.setdefault("invocations", []).append(invocation)

    report["targets"] = args.targets
    report["table"] = table(report["runs"], args.targets)
    args.out.write_text(json.dumps(report) + "\n")
    title = textwrap.fill(" ".join(report["settings"]["shared_overrides"]), 90)
    for path in plot(report["runs"], args.out, title):
        print(f"wrote {path}")
    print_table(report["table"], args.targets)


if __name__ == "__main__":
    main()
