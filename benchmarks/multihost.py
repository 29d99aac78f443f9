"""Runs across test hosts: throughput under link latency, and a host's cut and return, timed.

    .venv/bin/python benchmarks/multihost.py                 # everything, ~15 min on 2 cores
    .venv/bin/python benchmarks/multihost.py --only latency  # or: cut
    .venv/bin/python benchmarks/multihost.py --render        # the markdown from the JSON

The hosts are network namespaces on this machine (``asyncrl.testbed``, needs root) with
a Ray node each, as in ``tests/integration/test_multihost.py``: the buffer and the
learner on host a, one generator replica on each of b and c; every connection CURVE.

- **latency**: the quickstart (``--steps`` steps) with 0, 10, 50 and 200 ms added to
  what b and c send (a userspace relay, as netem on their interfaces would: the round
  trip to the head grows by that much), against the same run on one host (all roles on
  host a, one Ray node) and across plain veth cables (no relay). Samples/s and seconds
  per step between step ``--skip`` and the last (``common.steady_throughput``).
- **cut**: c's cable pulled for 30 s mid-run, then plugged back; the seconds from the
  cut to c's groups handed out again (the buffer's log), from the return to c heard from
  again, and to its first sample accepted after it, or to its replacement's (a replica
  whose engine a cut transfer left half loaded exits and is started again). Once with
  the quickstart's model (a weight transfer takes milliseconds) and once with a bigger
  one over a 10 Mbit/s cable (a transfer takes seconds, so the cut lands in one).

Writes ``docs/benchmarks/multihost.json`` and prints the markdown for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.helpers
import common  # benchmarks/ is not a package: found on sys.path

from asyncrl.testbed.ray_nodes import NodeSpec
from tests.helpers import multihost
from tests.helpers.faults import final_ledger

JSON_OUT = common.REPO / "docs" / "benchmarks" / "multihost.json"
DELAYS_MS = (0, 10, 50, 200)
CUT_S = 30.0
HEARTBEAT_TIMEOUT_S = 10.0
ONE_HOST = {"a": NodeSpec(4, {"learner_node": 1})}
BIGGER_MODEL = "model.tiny={hidden_size: 128, num_layers: 4, num_heads: 4, intermediate_size: 512}"


def throughput(name: str, steps: int, skip: int, work: Path, *, layout=None, delay_ms=None):
    """One quickstart run; its steady samples/s. ``delay_ms`` None: plain cables."""
    shaped = ("b", "c") if delay_ms is not None else ()
    with multihost.cluster(shaped=shaped, layout=layout) as hosts:
        for host in shaped:
            hosts.bed.shape(host, delay_ms, 0.0)
        started = time.monotonic()
        run = hosts.launch(work / name, f"run.total_steps={steps}")
        status = run.wait(1800)
        wall_s = time.monotonic() - started
    records = run.records()
    if status != 0 or len(records) != steps:
        raise RuntimeError(f"{name}: exit {status}, {len(records)} steps:\n{run.output()[-2000:]}")
    steady = common.steady_throughput(records, skip)
    final = sum(r["reward_mean"] for r in records[-10:]) / 10
    print(f"{name}: {steady['samples_per_s']:.0f} samples/s, {steady['step_s']:.3f} s/step, "
          f"final reward {final:.3f}, {wall_s:.0f} s", flush=True)  # fmt: skip
    return {"name": name, "delay_ms": delay_ms, "hosts": len(layout or multihost.LAYOUT),
            **steady, "final_reward": final, "launch_to_exit_s": wall_s}  # fmt: skip


def cut_and_return(name: str, work: Path, *overrides: str, limit: str | None = None) -> dict:
    """c's cable cut for ``CUT_S`` at step 15; the moments the buffer's log records."""
    ray_env = {"RAY_health_check_failure_threshold": "40"}  # Ray outlasts the cut
    with multihost.cluster(system_env=ray_env) as hosts:
        if limit:
            hosts.bed.limit("c", limit)
        run = hosts.launch(
            work / name, "run.total_steps=5000", "learner.checkpoint_every=10",
            f"buffer.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S:g}", *overrides,
        )  # fmt: skip
        run.wait_for_step(15)
        on_c = run.generator_on("10.77.0.3")
        cut = time.time()
        steps_at_cut = run.steps()
        hosts.bed.cut("c")
        time.sleep(CUT_S)
        steps_in_cut = run.steps() - steps_at_cut
        hosts.bed.restore("c")
        restored = time.time()
        run.until("c serving again", lambda: serves_again(run, on_c), timeout_s=300)
        run.wait_for_step(run.steps() + 10)
        run.process.send_signal(signal.SIGTERM)
        run.wait(180)
    log = run.log("buffer")
    requeued = multihost.logged_at(log, f"generator {on_c} silent for over")
    heard = multihost.logged_at(log, f"generator {on_c} is back after")
    accepted = multihost.logged_at(log, f"generator {on_c}: first sample accepted since")
    replaced = multihost.logged_at(log, rf"generator {on_c}-r1 \(pool default\) joined")
    first_replaced_step = next(
        (r["time_s"] for r in run.records() if r.get("generators_restarts_total", 0) >= 1), None
    )
    ledger = final_ledger(run.run_dir)
    result = {
        "name": name,
        "limit": limit,
        "steps_during_cut": steps_in_cut,
        "cut_to_requeued_s": None if requeued is None else requeued - cut,
        "return_to_heard_s": None if heard is None else heard - restored,
        "return_to_first_accepted_s": None if accepted is None else accepted - restored,
        "replaced": accepted is None and replaced is not None,
        "return_to_replacement_joined_s": None if replaced is None else replaced - restored,
        "repeated": len(ledger.repeated()),
        "unaccounted": len(ledger.unaccounted()),
        "trained": len(ledger.trained),
        "skipped": len(ledger.skipped),
        "first_step_with_replacement_time_s": first_replaced_step,
    }
    print(json.dumps(result), flush=True)
    return result


def serves_again(run: multihost.Launch, generator_id: str) -> bool:
    log = run.log("buffer")
    if f"generator {generator_id}: first sample accepted since" in log:
        return True
    records = run.records()
    return (f"generator {generator_id}-r1 (pool default) joined" in log and bool(records)
            and records[-1].get("generators_restarts_total", 0) >= 1)  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        f"Measured {report['date']} on {report['machine']['cpu']} "
        f"({report['machine']['cores']} cores), commit {report['commit']}: "
        "`.venv/bin/python benchmarks/multihost.py`.",
        "",
    ]
    if report.get("latency"):
        rows = report["latency"]
        before = {r["name"]: r for r in report.get("latency_before", [])}
        base = next(r for r in rows if r["hosts"] == 1)["samples_per_s"]
        lines += [
            "| hosts | added latency (b, c send) | samples/s | s/step | vs one host "
            "| before: samples/s | before: s/step | now over before |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            latency = "-" if r["hosts"] == 1 else (
                "plain cable" if r["delay_ms"] is None else f"{r['delay_ms']} ms (relay)"
            )
            old = before.get(r["name"])
            then = (f"{old['samples_per_s']:.0f} | {old['step_s']:.3f} "
                    f"| {r['samples_per_s'] / old['samples_per_s']:.2f}x" if old else "- | - | -")
            lines.append(
                f"| {r['hosts']} | {latency} | {r['samples_per_s']:.0f} | {r['step_s']:.3f} "
                f"| {r['samples_per_s'] / base:.2f}x | {then} |"
            )
        if before:
            lines += ["", f"Before: {report['latency_before_note']}"]
        lines.append("")
    for r in report.get("cut", []):
        how = (f"replaced: its replacement joined {r['return_to_replacement_joined_s']:.1f} s "
               "after the return" if r["replaced"] else
               f"came back: heard {r['return_to_heard_s']:.1f} s after the return, first "
               f"sample accepted {r['return_to_first_accepted_s']:.1f} s after it")  # fmt: skip
        lines.append(
            f"- **{r['name']}**: groups handed out again {r['cut_to_requeued_s']:.1f} s after "
            f"the cut; {r['steps_during_cut']} steps trained during the 30 s cut; c {how}; "
            f"{r['trained']} prompts trained, {r['skipped']} skipped, "
            f"{r['repeated']} trained twice, {r['unaccounted']} unaccounted."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=("latency", "cut"))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=30)
    parser.add_argument("--render", action="store_true")
    args = parser.parse_args()
    if args.render:
        print(markdown(json.loads(JSON_OUT.read_text())))
        return
    info = common.machine_info()
    report = json.loads(JSON_OUT.read_text()) if JSON_OUT.exists() and args.only else {}
    machine = {"cpu": info["cpu"], "cores": info["nproc"], "os": info["os"]}
    report |= {"date": time.strftime("%Y-%m-%d"), "commit": common.git_commit(),
               "machine": machine}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="asyncrl-multihost-") as folder:
        work = Path(folder)
        if args.only in (None, "latency"):
            steps, skip = args.steps, args.skip
            report.pop("latency_before", None)  # measured on an older commit: stale now
            report["latency"] = [
                throughput("one host", steps, skip, work, layout=ONE_HOST),
                throughput("three hosts, plain cables", steps, skip, work),
                *(throughput(f"three hosts, +{d} ms", steps, skip, work, delay_ms=d)
                  for d in DELAYS_MS),
            ]  # fmt: skip
        if args.only in (None, "cut"):
            report["cut"] = [
                cut_and_return("quickstart model, plain cable", work),
                cut_and_return(
                    "bigger model (4.2 MB of weights), c's cable at 10 Mbit/s", work,
                    BIGGER_MODEL, "weights.transport=collective", "weights.deadline_s=10",
                    limit="10mbit",
                ),
            ]
    JSON_OUT.parent.mkdir(parents=True, exist_ok=True)
    JSON_OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
