"""Plot a multi-turn tool run against wall time: reward, tool-call success and turns.

    python benchmarks/tool_curve.py RUN_DIR --out docs/benchmarks/smollm2_tools

writes ``OUT.png`` (three panels: training and held-out reward; the share of
episodes with at least one successful tool call, in training batches and in eval
rounds; model turns per episode) and ``OUT.json`` (learning_curve.py's summary of
the eval rounds, each round with its tool-call success share and turns). Reads
RUN_DIR/metrics.jsonl only, so it works on a live run too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import moving_average
from learning_curve import eval_rounds, summarise

from asyncrl.run.status import read_records

SMOOTH = 10
"""Training series are drawn as the mean of this many steps."""


def episode_rounds(records: list[dict]) -> list[dict]:
    """learning_curve's eval rounds, each with its episodes' tool success and turns."""
    rounds = eval_rounds(records)
    reported = [r for r in records if r.get("eval_reward_mean") is not None]
    for round_, record in zip(rounds, reported, strict=True):
        round_["tool_success"] = record.get("eval_tool_success_frac")
        round_["turns"] = record.get("eval_turns_mean")
    return rounds


def plot(records: list[dict], rounds: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in records if not r.get("eval_only") and "reward_mean" in r]
    minutes = [float(r["time_s"]) / 60 for r in steps]
    rounds_at = [r["minutes"] for r in rounds]
    panels = (
        ("reward", "reward_mean", "reward"),
        ("episodes with a successful tool call", "episode_tool_success_frac", "tool_success"),
        ("model turns per episode", "episode_turns_mean", "turns"),
    )
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, (name, step_key, round_key) in zip(axes, panels, strict=True):
        series = [float(r.get(step_key, float("nan"))) for r in steps]
        axis.plot(minutes, moving_average(series, SMOOTH), alpha=0.7,
                  label=f"training (mean of {SMOOTH} steps)")  # fmt: skip
        axis.plot(rounds_at, [r[round_key] for r in rounds], "o-", label="held-out eval")
        axis.set_title(name)
        axis.set_xlabel("minutes since launch")
        axis.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    parser.add_argument("--rise", type=float, default=0.2)
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    records = read_records(args.run_dir)
    rounds = episode_rounds(records)
    summary = summarise(rounds, args.rise)
    summary["run_dir"] = str(args.run_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(records, rounds, args.title or args.run_dir.name, args.out.with_suffix(".png"))
    first, best = summary["first"], summary["best"]
    print(
        f"eval reward {first['reward']:.3f} (tool success {first['tool_success']}) at "
        f"v{first['version']} -> best {best['reward']:.3f} (tool success "
        f"{best['tool_success']}) at v{best['version']}, {best['minutes']:.1f} min; "
        f"{len(rounds)} rounds"
    )


if __name__ == "__main__":
    main()
