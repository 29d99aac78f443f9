"""Plot a run's learning curve: training and held-out eval reward against wall time
and samples, and summarise the eval curve.

    python benchmarks/learning_curve.py RUN_DIR --out docs/benchmarks/smollm2_arithmetic

writes ``OUT.png`` and ``OUT.json``: the eval rounds (policy version, reward,
minutes since launch, samples trained so far), the first and best eval reward,
and the first round at least ``--rise`` above the first one with its wall time.
Reads RUN_DIR/metrics.jsonl only, so it works on a finished run or a live one.

``--beside LABEL=JSON`` (repeatable) draws the eval rounds of another run's
``OUT.json`` on the same axes, to compare two configurations side by side:

    python benchmarks/learning_curve.py runs/lora --out docs/benchmarks/smollm2_arithmetic_lora \
        --label LoRA --beside "full fine-tuning=docs/benchmarks/smollm2_arithmetic.json"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import moving_average

from asyncrl.run.status import read_records


def eval_rounds(records: list[dict]) -> list[dict]:
    """One entry per eval round, in the order logged: the line that reported it."""
    rounds = []
    trained = 0  # an eval-only line (after the last step) has no count of its own
    for record in records:
        trained = int(record.get("samples_total", trained))
        if record.get("eval_reward_mean") is None:
            continue
        rounds.append(
            {
                "version": int(record["eval_policy_version"]),
                "reward": float(record["eval_reward_mean"]),
                "samples": int(record["eval_samples"]),
                "minutes": float(record["time_s"]) / 60,
                "trained_samples": trained,
                "final": bool(record.get("eval_final")),
            }
        )
    return rounds


def summarise(rounds: list[dict], rise: float) -> dict:
    if not rounds:
        raise ValueError("no eval round in metrics.jsonl (eval.every_steps = 0?)")
    first = rounds[0]
    best = max(rounds, key=lambda r: r["reward"])
    risen = next((r for r in rounds if r["reward"] >= first["reward"] + rise), None)
    return {
        "first": first,
        "best": best,
        "rise": best["reward"] - first["reward"],
        f"first_round_up_{rise}": risen,
        "rounds": rounds,
    }


def beside_runs(specs: list[str]) -> dict[str, list[dict]]:
    """``LABEL=PATH`` of summaries this script wrote: each label's eval rounds."""
    found = {}
    for spec in specs:
        label, separator, path = spec.partition("=")
        if not separator or not label or not path:
            raise SystemExit(f"--beside {spec!r}: give LABEL=PATH of a summary JSON")
        found[label] = json.loads(Path(path).read_text())["rounds"]
    return found


def plot(
    records: list[dict],
    rounds: list[dict],
    title: str,
    path: Path,
    label: str = "",
    beside: dict[str, list[dict]] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if not r.get("eval_only")]
    train = moving_average([float(r["reward_mean"]) for r in steps], 10)
    minutes = [float(r["time_s"]) / 60 for r in steps]
    samples = [int(r["samples_total"]) for r in steps]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, x, ex, x_label in (
        (axes[0], minutes, [r["minutes"] for r in rounds], "minutes since launch"),
        (axes[1], samples, [r["trained_samples"] for r in rounds], "samples trained"),
    ):
        prefix = f"{label}: " if label else ""
        axis.plot(x, train, label=f"{prefix}training reward (mean of 10 steps)", alpha=0.7)
        axis.plot(ex, [r["reward"] for r in rounds], "o-", label=f"{prefix}held-out eval reward")
        for other, other_rounds in (beside or {}).items():
            key = "minutes" if axis is axes[0] else "trained_samples"
            axis.plot(
                [r[key] for r in other_rounds],
                [r["reward"] for r in other_rounds],
                "s--",
                alpha=0.8,
                label=f"{other}: held-out eval reward",
            )
        axis.set_xlabel(x_label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="lower right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    parser.add_argument("--rise", type=float, default=0.15)
    parser.add_argument("--title", default=None)
    parser.add_argument("--label", default="", help="this run's name in the legend")
    parser.add_argument(
        "--beside", action="append", default=[], metavar="LABEL=JSON",
        help="another run's summary (this script's OUT.json) drawn on the same axes",
    )  # fmt: skip
    args = parser.parse_args(argv)
    beside = beside_runs(args.beside)
    records = read_records(args.run_dir)
    rounds = eval_rounds(records)
    summary = summarise(rounds, args.rise)
    summary["run_dir"] = str(args.run_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    title = args.title or args.run_dir.name
    plot(records, rounds, title, args.out.with_suffix(".png"), args.label, beside)
    first, best = summary["first"], summary["best"]
    print(
        f"eval reward {first['reward']:.3f} at v{first['version']} -> best "
        f"{best['reward']:.3f} at v{best['version']} ({best['minutes']:.1f} min, "
        f"{best['trained_samples']} samples); {len(rounds)} rounds"
    )


if __name__ == "__main__":
    main()
