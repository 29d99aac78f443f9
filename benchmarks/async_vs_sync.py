"""Asynchronous against synchronous RL on the same config, side by side in one invocation.

    .venv/bin/python benchmarks/async_vs_sync.py                 # full run (about 4 minutes)
    .venv/bin/python benchmarks/async_vs_sync.py --quick         # 30 steps, 1 round
    .venv/bin/python benchmarks/async_vs_sync.py --config configs/smollm2_arithmetic.yaml \
        --steps 8 --rounds 1 --skip-frac 0.25 --set eval.every_steps=0   # the real model

Each round launches the config twice with ``asyncrl launch`` (alternating which
goes first): synchronous (``buffer.max_staleness=0``, ``learner.sync_interval=1``:
the buffer hands out the next batch's prompts only once the learner has asked
for it with the new weights, so generation and training take turns) and
asynchronous (``buffer.max_staleness=K``). Rates are taken over the steady part
of each run (the first ``--skip-frac`` of the steps are left out).

Generation alone (Tg) and training alone (Tt) come from the synchronous run,
where the two phases never overlap: Tg is the mean time the learner waited for
a batch (prompts handed out, weights fetched, samples generated, scored and
sent, the batch formed), Tt the rest of its step (update, publish, logging),
so Tg + Tt is exactly the synchronous step. The ideal async/sync ratio is
``(Tg + Tt) / max(Tg, Tt)``. As a cross-check, the engine alone (the HF backend
generating one batch in chunks, no sockets, no scoring) is timed in this process.

Weights reach the replica over ``--transport`` (``weights.transport``, both
modes): ``shm`` by default, the fast same-host path, whose "anything newer?"
before each chunk is a read of the segment's header (the run default); ``zmq``
asks the learner's weight server before every chunk, a round trip that waits
for the learner's process while it trains.

Busy fractions: the learner's is 1 - its wait share (from metrics.jsonl); every
role's also comes from the kernel's scheduler counters of its main thread (time
on a CPU or runnable, over wall time), read by :class:`common.BusySampler`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # benchmarks/ is not a package: found on sys.path

DEFAULT_OUT = common.REPO / "docs" / "benchmarks" / "async_vs_sync.json"


def settings_overrides(args: argparse.Namespace) -> list[str]:
    """Overrides both modes share: length, threads, one replica, no aim."""
    return [
        f"run.total_steps={args.steps}",
        f"generators.replicas={args.replicas}",
        f"learner.num_threads={args.threads}",
        f"generators.num_threads={args.threads}",
        f"weights.transport={args.transport}",
        "tracking.aim=false",
        *args.set,
    ]


def mode_overrides(mode: str, staleness: int) -> list[str]:
    if mode == "sync":
        return ["buffer.max_staleness=0", "learner.sync_interval=1"]
    return [f"buffer.max_staleness={staleness}", "learner.sync_interval=1"]


def summarize(result: common.RunResult, skip_frac: float) -> dict[str, object]:
    """Steady-state rates, phase times and busy fractions of one launch."""
    metrics = result.metrics
    skip = max(1, int(len(metrics) * skip_frac))
    steady = metrics[skip:]
    rates = common.steady_throughput(metrics, skip)
    wait_s = statistics.fmean(m["learner_wait_s"] for m in steady)
    busy = result.sampler.busy(skip, len(metrics) - 1)
    return {
        "overrides": result.overrides,
        "launch_s": result.seconds,
        "loadavg_1min": list(result.loadavg),
        **rates,
        "wait_s": wait_s,
        "update_s": statistics.fmean(m["time_update_s"] for m in steady),
        "publish_stall_s": statistics.fmean(m["time_publish_stall_s"] for m in steady),
        "learner_busy_frac": 1 - wait_s / rates["step_s"],
        "busy": busy,
        "staleness_mean": statistics.fmean(m["staleness_mean"] for m in steady),
        "evicted_frac": metrics[-1].get("buffer_evicted_frac", 0.0),
        "reward_last10": statistics.fmean(m["reward_mean"] for m in metrics[-10:]),
    }


def engine_generation_s(config_path: Path, overrides: list[str], repeats: int) -> float:
    """Seconds for the HF backend alone to generate one batch the way a replica does.

    ``max_active_samples`` rollouts at a time, topped up between chunks of
    ``chunk_tokens``, until ``samples_per_step`` are finished; the model is the
    config's, freshly initialised (responses run to ``max_new_tokens`` or EOS).
    """
    import torch

    from asyncrl.config import load_config
    from asyncrl.generation.models import build_policy
    from asyncrl.generation.tasks import work_item_factory
    from asyncrl.generators.hf_backend import HFBackend, Rollout

    config = load_config(config_path, overrides)
    torch.set_num_threads(config.generators.num_threads)
    model, tokenizer = build_policy(config.model, seed=config.run.seed)
    backend = HFBackend(model, tokenizer, config.generators)
    make_item = work_item_factory(config)
    wanted = config.algorithm.samples_per_step
    gen = config.generators
    times = []
    for repeat in range(repeats + 1):  # the first is a warm-up
        pending = []
        for index in range(wanted // config.algorithm.group_size):
            item = make_item(repeat * 10_000 + index)
            pending += [
                Rollout(item.group_id, i, list(item.prompt_ids), item.ground_truth)
                for i in range(item.num_samples)
            ]
        active: list[Rollout] = []
        done = 0
        start = time.perf_counter()
        while done < wanted:
            room = gen.max_active_samples - len(active)
            active, pending = active + pending[:room], pending[room:]
            backend.generate_chunk(active, gen.chunk_tokens)
            done += sum(r.finished for r in active)
            active = [r for r in active if not r.finished]
        if repeat:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def work_per_step(run: dict, role_prefix: str) -> float | None:
    """Seconds per step a role's main thread was busy (mean over replicas), from the kernel."""
    fractions = [v["busy_frac"] for k, v in run["busy"].items() if k.startswith(role_prefix)]
    return statistics.fmean(fractions) * run["step_s"] if fractions else None


def compare(sync: dict, asynchronous: dict) -> dict[str, float | None]:
    """The ideal async/sync ratio, two ways, against the measured one.

    Work: Tg and Tt are the seconds per step the generator and the learner were
    busy in the sync run; whatever else the sync step holds is lockstep idle
    time (neither busy: polls, replies, scoring), which an async run can hide
    too. Phases: Tg is the learner's wait in the sync run, Tt the rest of its
    step, so Tg + Tt is the whole sync step and the idle time counts as generation.
    """
    measured = asynchronous["samples_per_s"] / sync["samples_per_s"]
    tg_wait = sync["wait_s"]
    tt_rest = sync["step_s"] - tg_wait
    out: dict[str, float | None] = {
        "samples_ratio": measured,
        "tokens_ratio": asynchronous["tokens_per_s"] / sync["tokens_per_s"],
        "tg_wait_s": tg_wait,
        "tt_rest_s": tt_rest,
        "ideal_ratio_phases": common.ideal_ratio(tg_wait, tt_rest),
        "tg_s": None,
        "tt_s": None,
    }
    tg, tt = work_per_step(sync, "generator"), work_per_step(sync, "learner")
    if tg is None or tt is None:  # too short a run for the sampler to bracket
        return out
    ideal = common.ideal_ratio(tg, tt)
    out |= {
        "tg_s": tg,
        "tt_s": tt,
        "sync_idle_s": sync["step_s"] - tg - tt,
        "ideal_ratio": ideal,
        "of_ideal": measured / ideal,
        "speedup_captured": common.speedup_captured(measured, ideal),
        "ceiling_vs_this_sync": sync["step_s"] / max(tg, tt),
        "async_step_s": asynchronous["step_s"],
        "overlap_efficiency": max(tg, tt) / asynchronous["step_s"],
    }
    return out


def summarize_rounds(rounds: list[dict]) -> dict[str, object]:
    """Means over rounds of every comparison figure, and each round's ratio."""
    keys = [k for k, v in rounds[0].items() if isinstance(v, float)]
    summary: dict[str, object] = {
        key: statistics.fmean(r[key] for r in rounds if r.get(key) is not None)
        for key in keys
        if any(r.get(key) is not None for r in rounds)
    }
    summary["samples_ratio_per_round"] = [r["samples_ratio"] for r in rounds]
    summary["ideal_ratio_per_round"] = [r.get("ideal_ratio") for r in rounds]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=common.REPO / "configs/quickstart.yaml")
    parser.add_argument("--steps", type=int, default=200, help="run.total_steps of each launch")
    parser.add_argument("--staleness", type=int, default=1, help="K of the async run")
    parser.add_argument("--rounds", type=int, default=3, help="sync/async pairs")
    parser.add_argument("--replicas", type=int, default=1, help="generators.replicas")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--skip-frac", type=float, default=0.2, help="start-up share left out")
    parser.add_argument("--nice", type=int, default=0, help="run the launches under nice -n")
    parser.add_argument(
        "--transport", choices=("zmq", "shm"), default="shm", help="weights.transport of both"
    )
    parser.add_argument("--set", action="append", default=[], help="extra key=value override")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/asyncrl-bench/async_vs_sync"))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="30 steps, 1 round: a smoke test")
    parser.add_argument(
        "--recompute", action="store_true", help="recompute --out's comparisons, run nothing"
    )
    args = parser.parse_args()
    if args.recompute:
        report = json.loads(args.out.read_text())
        report["rounds"] = [
            {key: r[key] for key in ("order", "sync", "async")} | compare(r["sync"], r["async"])
            for r in report["rounds"]
        ]
        report["summary"] = summarize_rounds(report["rounds"]) | {
            "engine_generation_s": report["summary"]["engine_generation_s"]
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report["summary"], indent=1))
        return
    if args.quick:
        args.steps, args.rounds = 30, 1
    args.config = args.config.resolve()
    shared = settings_overrides(args)
    machine = common.machine_info() | {"loadavg_start": common.loadavg()}
    started = time.monotonic()
    engine_s = engine_generation_s(args.config, shared, repeats=1 if args.quick else 5)
    print(f"engine alone: {engine_s:.4f} s per batch", flush=True)

    rounds = []
    for index in range(args.rounds):
        order = ("sync", "async") if index % 2 == 0 else ("async", "sync")
        runs = {}
        for mode in order:
            overrides = shared + mode_overrides(mode, args.staleness)
            run_dir = args.work_dir / f"round{index}-{mode}"
            result = common.launch(args.config, overrides, run_dir, nice=args.nice)
            runs[mode] = summarize(result, args.skip_frac)
            print(
                f"round {index} {mode:5s}: {runs[mode]['samples_per_s']:8.1f} samples/s, "
                f"step {runs[mode]['step_s'] * 1e3:.1f} ms, wait {runs[mode]['wait_s'] * 1e3:.1f} "
                f"ms, staleness {runs[mode]['staleness_mean']:.2f}",
                flush=True,
            )
        rounds.append({"order": list(order), **runs, **compare(runs["sync"], runs["async"])})
        print(json.dumps({k: v for k, v in rounds[-1].items() if k not in order}), flush=True)

    summary = summarize_rounds(rounds) | {"engine_generation_s": engine_s}
    machine["loadavg_end"] = common.loadavg()
    report = {
        "machine": machine,
        "command": " ".join(["python", "benchmarks/async_vs_sync.py", *sys.argv[1:]]),
        "seconds": time.monotonic() - started,
        "settings": {
            "config": str(args.config.relative_to(common.REPO)),
            "shared_overrides": shared,
            "sync_overrides": mode_overrides("sync", args.staleness),
            "async_overrides": mode_overrides("async", args.staleness),
            "skip_frac": args.skip_frac,
            "rounds": args.rounds,
            "nice": args.nice,
            "transport": args.transport,
        },
        "summary": summary,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
