"""Plot a run's learning curve: training and held-out eval reward against wall time
and samples, and summarise the eval curve.

    python benchmarks/learning_curve.py RUN_DIR --out docs/benchmarks/smollm2_arithmetic

writes ``OUT.png`` and ``OUT.json``: the eval rounds (policy version, reward,
minutes since launch, samples trained so far), the first and best eval reward,
and the first round at least ``--rise`` above the first one with its wall time.
Reads RUN_DIR/metrics.jsonl only, so it works on a finished run or a live one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import moving_average

from asyncrl.status import read_records


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


def plot(records: list[dict], rounds: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if not r.get("eval_only")]
    train = moving_average([float(r["reward_mean"]) for r in steps], 10)
    minutes = [float(r["time_s"]) / 60 for r in steps]
    samples = [int(r["samples_total"]) for r in steps]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, x, ex, label in (
        (axes[0], minutes, [r["minutes"] for r in rounds], "minutes since launch"),
        (axes[1], samples, [r["trained_samples"] for r in rounds], "samples trained"),
    ):
        axis.plot(x, train, label="training reward (mean of 10 steps)", alpha=0.7)
        axis.plot(ex, [r["reward"] for r in rounds], "o-", label="held-out eval reward")
        axis.set_xlabel(label)
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
    args = parser.parse_args(argv)
    records = read_records(args.run_dir)
    rounds = eval_rounds(records)
    summary = summarise(rounds, args.rise)
    summary["run_dir"] = str(args.run_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(records, rounds, args.title or args.run_dir.name, args.out.with_suffix(".png"))
    first, best = summary["first"], summary["best"]
    print(
        f"eval reward {first['reward']:.3f} at v{first['version']} -> best "
        f"{best['reward']:.3f} at v{best['version']} ({best['minutes']:.1f} min, "
        f"{best['trained_samples']} samples); {len(rounds)} rounds"
    )


if __name__ == "__main__":
    main()
