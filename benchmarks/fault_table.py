"""The fault table: each fault of docs/running.md injected into a real run, and measured.

    .venv/bin/python benchmarks/fault_table.py                   # every scenario, ~4 min, 2 cores
    .venv/bin/python benchmarks/fault_table.py --only stopping   # some (see SCENARIOS)
    .venv/bin/python benchmarks/fault_table.py --render          # the markdown from the JSON

The scenarios are those of ``tests/integration/test_faults.py`` (from
``tests/helpers/faults/``), run once more here so the table's figures
come from the shipped system: for each fault whether the run went on or stopped,
the line that names it, what was lost, what resume did, which processes were left,
and the seconds from the fault to the run going on again (or to its last process
gone). The tests assert the behaviour and never the durations; this writes both
to ``docs/faults.json`` and the table to ``docs/fault_table.md``. A scenario that
fails is recorded as failed, with its assertion, and the others still run.
Mounting needs root; without it the disk-full row is left out (not measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.helpers
import common  # benchmarks/ is not a package: found on sys.path

from tests.helpers import faults as harness

JSON_OUT = common.REPO / "docs" / "faults.json"
MARKDOWN_OUT = common.REPO / "docs" / "fault_table.md"
TESTS = "test_faults.py"
"""Test files are named from tests/integration/ (tests/unit/ spelled out)."""
SUPERVISION = "test_supervision.py"
CONTAINED_TEST = (
    f"{TESTS}::test_reward_chunk_tracker_and_generator_faults_are_contained_and_the_run_goes_on"
)
STOPPING_TEST = f"{TESTS}::test_killed_rank_launcher_and_full_disk_stop_the_run_and_resume_goes_on"

SCENARIOS: dict[str, Callable[[Path], object]] = {
    "killed-generator": harness.killed_generator,
    "killed-buffer": harness.killed_buffer,
    "contained": harness.contained_faults,
    "stopping": harness.stopping_faults,
    "unwritable": harness.unwritable_run_dir,
}
"""Scenario name -> the harness function (it returns a Case or a dict of them)."""

ROWS: list[tuple[str, str, str]] = [
    # (case key, scenario, the tests behind the row)
    ("killed-generator", "killed-generator",
     f"{SUPERVISION}::test_a_killed_generator_is_restarted_and_the_run_trains_every_group"),
    ("killed-buffer", "killed-buffer",
     "test_buffer_death.py::"
     "test_a_killed_buffer_leaves_a_complete_checkpoint_of_the_last_step_and_resume_repeats_none"),
    ("learner-rank", "stopping", STOPPING_TEST),
    ("launcher", "stopping",
     f"{STOPPING_TEST}; {SUPERVISION}::"
     "test_a_run_killed_outright_resumes_without_repeating_or_skipping_a_prompt"),
    ("generator-stop", "contained", CONTAINED_TEST),
    ("slow-chunk", "contained", CONTAINED_TEST),
    ("tracker", "contained", CONTAINED_TEST),
    ("disk", "stopping",
     f"{STOPPING_TEST}; "
     "test_disk_full.py::test_a_run_whose_disk_fills_stops_at_once_naming_the_file"),
    ("unwritable", "unwritable",
     f"{TESTS}::test_an_unwritable_run_directory_is_refused_in_one_line"),
    ("reward-hang", "contained",
     f"{CONTAINED_TEST}; "
     "tests/unit/rewards/test_rewards.py::test_a_hanging_function_times_out_without_blocking_the_caller"),
    ("reward-crash", "contained",
     f"{CONTAINED_TEST}; "
     "tests/unit/rewards/test_rewards.py::"
     "test_a_function_that_kills_its_worker_scores_zero_and_the_worker_is_replaced"),
    ("reward-flood", "contained", CONTAINED_TEST),
]  # fmt: skip


# ------------------------------------------------------------------------ running


def run_scenario(name: str) -> dict[str, dict]:
    """Run one scenario in a fresh directory; its cases as JSON-ready dicts, by key."""
    with tempfile.TemporaryDirectory(prefix=f"asyncrl-faults-{name}-") as work:
        started = time.time()
        try:
            result = SCENARIOS[name](Path(work))
        except harness.MountUnavailable as why:
            return {name: {"scenario": name, "not_run": str(why)}}
        except AssertionError as failure:
            return {name: {"scenario": name, "failed": str(failure)[-2000:]}}
        cases = result if isinstance(result, dict) else {name: result}
        took = time.time() - started
        return {key: case_record(case, name, took) for key, case in cases.items()}


def case_record(case: harness.Case, scenario: str, took_s: float) -> dict:
    """A case as JSON: its fields, its ledger as a summary, the scenario's wall time."""
    record = dataclasses.asdict(case)
    notes = dict(case.notes)
    ledger = notes.pop("ledger", None)
    if isinstance(ledger, harness.Ledger):
        notes["ledger"] = {
            "handed_out": ledger.cursor,
            "trained_twice": ledger.repeated(),
            "never_named": ledger.unaccounted(),
            "skipped": len(ledger.skipped),
            "skipped_prompts_jsonl_matches": ledger.listed == ledger.skipped,
        }
    record |= {"notes": notes, "lost_steps": case.lost_steps, "scenario": scenario,
               "scenario_s": round(took_s, 1)}  # fmt: skip
    return record


# ---------------------------------------------------------------------- rendering


WORK_DIR = re.compile(r"/\S*?asyncrl-faults-[^/\s]+/(?:disk/run|unwritable/run|[^/\s]+)")
"""A scenario's run directory in a message (a temporary directory): shown as RUN_DIR."""


def cell(text: str, limit: int = 220) -> str:
    """One table cell: one line, pipes escaped, run directories as RUN_DIR, clipped."""
    text = WORK_DIR.sub("RUN_DIR", " ".join(text.split())).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def strip_log_prefix(line: str) -> str:
    """``2026-01-01 10:00:00,000 generator-0 WARNING asyncrl.generation.rewards: x`` -> ``x``."""
    head, sep, tail = line.partition(": ")
    return tail if sep and head.count(" ") >= 3 and head[:4].isdigit() else line


def quote(case: dict) -> str:
    """The line that names the fault (the most telling of the case's message)."""
    lines = [strip_log_prefix(line.strip()) for line in case["message"].splitlines()]
    lines = [line for line in lines if line and not line.startswith(("File ", "[rank"))]
    for hint in ("No space", "run failed", "stalled", "exited with status", "error:",
                 "not shown", "aim", "cannot", "signal"):  # fmt: skip
        for line in lines:
            if hint in line:
                return f"`{cell(line, 200)}`"
    return f"`{cell(lines[0], 200)}`" if lines else "(nothing: no error)"


def outcome(case: dict) -> str:
    if case["went_on"]:
        return "goes on"
    if case["status"] is None:
        return "stops (every process gone)"
    return f"stops, exit {case['status']}"


def lost(case: dict) -> str:
    """Steps after the checkpoint a resume starts from; prompts by id; the ledger check."""
    parts = []
    if not case["went_on"] and case["checkpoint"] is not None:
        steps, at = case["lost_steps"], case["checkpoint"]
        parts.append(f"{steps} step(s) after step-{at:06d}, trained again" if steps
                     else f"no step (checkpoint at step {at})")  # fmt: skip
    elif not case["went_on"]:
        parts.append("nothing started")
    ids = [skip["group_id"] for skip in case["skipped"]]
    parts.append(f"prompts skipped: {ids}" if ids else "no prompt skipped")
    ledger = case["notes"].get("ledger")
    if ledger and not ledger["trained_twice"] and not ledger["never_named"]:
        parts.append(f"each of the {ledger['handed_out']} prompts handed out trained once, "
                     "waiting in the buffer, or named as skipped")  # fmt: skip
    elif ledger:
        parts.append(f"trained twice {ledger['trained_twice']}, unnamed {ledger['never_named']}")
    return "; ".join(parts + extra_lost(case))


def extra_lost(case: dict) -> list[str]:
    notes = case["notes"]
    extra = []
    if "reward errors" in notes:
        extra.append("the sample scored 0 with an error tag")
    if notes.get("dropped stale samples"):
        extra.append(f"{notes['dropped stale samples']:.0f} samples evicted as stale, "
                     "their prompts handed out again")  # fmt: skip
    if "log growth bytes" in notes:
        extra.append(f"64 MiB printed; the log grew {notes['log growth bytes']} bytes")
    if "aim failures" in notes:
        extra.append("aim's series from the failure on (metrics.jsonl complete)")
    return extra


def resumed(case: dict) -> str:
    if case["went_on"]:
        return "not needed"
    if case["resumed"] is None:
        return "nothing to resume" if case["status"] == 2 else "not tried"
    return (f"`--resume` from step-{case['resumed_from']:06d}: run finished, exit "
            f"{case['resumed']}" if case["resumed_from"] is not None
            else f"no checkpoint; exit {case['resumed']}")  # fmt: skip


def timing(case: dict) -> str:
    """Seconds from the fault to the run going on (or stopped), and the learner's wait."""
    parts = []
    if case["seconds"] is not None:
        parts.append(f"{case['seconds']:.1f} s")
    if case["held_up_s"] is not None:
        parts.append(f"learner waited at most {case['held_up_s']:.1f} s")
    exits = case["notes"].get("exits after s")
    if exits:
        each = ", ".join(f"{role} {s:.1f}" for role, s in exits.items())
        parts.append(f"exited after (s): {each}")
    return "; ".join(parts) or "-"


HEADER = ("| fault | the run | what it says | lost | resume | processes left | time | test |\n"
          "|---|---|---|---|---|---|---|---|")  # fmt: skip


def row(key: str, results: dict[str, dict], tests: str, scenario: str) -> str:
    case = results.get(key) or results.get(scenario, {})
    if not case:
        return f"| {key} | not measured (run `--only {scenario}`) | | | | | | {tests} |"
    if "failed" in case or "not_run" in case:
        why = case.get("failed") or case.get("not_run")
        label = "FAILED" if "failed" in case else "not run"
        return f"| {key} | **{label}** | `{cell(why, 300)}` | | | | | {tests} |"
    left = ", ".join(case["leftovers"]) or "none"
    return (f"| {case['fault']} | {outcome(case)} | {quote(case)} | {cell(lost(case), 400)} | "
            f"{resumed(case)} | {left} | {timing(case)} | {tests} |")  # fmt: skip


def render(results: dict[str, dict], machine: dict, command: str) -> str:
    rows = [row(key, results, tests, scenario) for key, scenario, tests in ROWS]
    return "\n".join([
        "# Fault table (measured)",
        "",
        f"Measured {machine['date']} on {machine['nproc']} CPU cores ({machine['cpu']}), "
        f"GPU: {machine['gpu']}, torch {machine['torch']}, with `{command}`. Runs are the "
        "quickstart config shortened, `buffer.heartbeat_timeout_s=3`, "
        f"`run.stall_timeout_s={harness.STALL_S}`; the machine was shared (load average "
        f"{machine.get('loadavg')}), so the seconds are an upper bound.",
        "",
        "*time*: from the fault to the faulty part back (the replacement's samples trained, "
        "the sample scored) or, for a run that stops, to the launcher's exit (every process of "
        "the run is gone by then); *learner waited*: the longest gap between two learner steps "
        "from the fault on."
        + (" Rows of the scenarios not named after `--only` are an earlier run's." if
           "--only" in command else ""),
        "",
        HEADER,
        *rows,
        "",
    ])  # fmt: skip


# --------------------------------------------------------------------------- main


def earlier_results(path: Path) -> dict[str, dict]:
    """The results already in ``path`` (``--only`` replaces its scenarios' among them)."""
    if not path.exists():
        return {}
    return json.loads(path.read_text())["results"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="these scenarios")
    parser.add_argument("--json", type=Path, default=JSON_OUT)
    parser.add_argument("--markdown", type=Path, default=MARKDOWN_OUT)
    parser.add_argument("--render", action="store_true", help="rewrite the markdown from --json")
    args = parser.parse_args()
    command = "python benchmarks/fault_table.py"
    if args.only:
        command += f" --only {' '.join(args.only)}"
    if args.render:
        saved = json.loads(args.json.read_text())
        args.markdown.write_text(render(saved["results"], saved["machine"], saved["command"]))
        return
    machine = common.machine_info() | {"loadavg": common.loadavg()}
    results = earlier_results(args.json) if args.only else {}
    for name in args.only or list(SCENARIOS):
        results = {key: case for key, case in results.items() if case.get("scenario") != name}
        print(f"fault_table: {name} ...", file=sys.stderr, flush=True)
        results |= run_scenario(name)
    machine["loadavg_after"] = common.loadavg()
    saved = {"machine": machine, "command": command, "results": results}
    args.json.write_text(json.dumps(saved, indent=1, default=str) + "\n")
    table = render(results, machine, command)
    args.markdown.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
