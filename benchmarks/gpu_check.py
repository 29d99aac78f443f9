"""The prepared GPU check (issue 29): every CUDA path of the project, run and measured by one
command in the first minutes a GPU machine is lent.

    bash scripts/gpu_check.sh            # installs what the machine lacks, then runs this
    python benchmarks/gpu_check.py --out DIR --budget-s 400     # asyncrl importable already

::

    runner (this process: standard library only, never touches CUDA)
      ├─ child: device            GPU name, versions, bf16 peak, a matmul's TFLOP/s
      ├─ child: tests_gpu         pytest tests/gpu, pass or fail per test
      ├─ child: learner_step_*    FSDP2 bf16 step of a Qwen2-shaped model: tokens/s, MFU, memory
      ├─ child: quickstart        learner and one HF generator on the GPU, async against sync
      ├─ child: generation        HF generation tokens/s on CUDA at a realistic batch
      └─ child: weights_publish   publish-to-loaded by shm and CUDA IPC against a D2H copy

Each check runs in a process of its own (a fresh CUDA context, its memory freed after it)
under a time cap, and writes its figures as it measures them (:class:`Figures`): a check
that fails, hangs past its cap or crashes loses nothing the others measured, and nothing
it measured before. The runner rewrites ``DIR/gpu_check.json`` after every check and
appends each check's output to ``DIR/gpu_check.log``. The checks share ``--budget-s``:
one starts only while at least :data:`MIN_START_S` of it are left, capped by what is left.

On a machine without CUDA every CUDA-only check is reported as skipped, by name, and is
rehearsed at a toy size on the CPU (``rehearsal`` in its entry; :data:`REHEARSAL_FACTOR`
times the caps and the budget): the same code runs, so what breaks on a GPU is the GPU's
part, not a typo.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIN_START_S = 20.0
"""A check starts only while this much of the budget is left."""
NO_CUDA = "needs CUDA: torch.cuda.is_available() is False on this machine"
REHEARSAL_FACTOR = 3
"""A CPU rehearsal gets this many times each cap and the budget: a shared CPU starts
processes and runs even toy models slower than a GPU machine runs the real ones."""


@dataclass(frozen=True)
class Check:
    """One check: ``module:function`` under benchmarks/, called as ``function(figures,
    device, **options)``; ``rehearsal`` holds the options of its toy run on the CPU."""

    name: str
    function: str
    cap_s: float
    cuda_only: bool
    options: dict = field(default_factory=dict)
    rehearsal: dict | None = None


QWEN_BATCH = {"rows": 16, "seq_len": 512, "steps": 3}
TOY_BATCH = {"shape": "toy", "rows": 8, "seq_len": 32, "steps": 2}
CHECKS = (
    Check("device", "gpu_model_checks:device_check", 60, False),
    Check("tests_gpu", "gpu_run_checks:gpu_tests", 150, False),
    Check(
        "learner_step_0.5b", "gpu_model_checks:learner_step", 60, True,
        {"shape": "qwen2-0.5b", "microbatch_tokens": 8192, **QWEN_BATCH},
        {**TOY_BATCH, "microbatch_tokens": 256},
    ),
    Check(
        "quickstart_async_vs_sync", "gpu_run_checks:quickstart", 150, True,
        {"steps": 60}, {"steps": 10},
    ),
    Check(
        "generation", "gpu_model_checks:generation", 45, True,
        {"shape": "qwen2-0.5b", "batch": 64, "prompt_len": 128, "new_tokens": 128,
         "chunk_tokens": 32},
        {"shape": "toy", "batch": 4, "prompt_len": 8, "new_tokens": 8, "chunk_tokens": 4},
    ),
    Check(
        "weights_publish", "gpu_weights_check:weights_publish", 75, True,
        {"shape": "qwen2-0.5b", "repeats": 3}, {"shape": "toy", "repeats": 2},
    ),
    Check(
        "learner_step_1.5b", "gpu_model_checks:learner_step", 60, True,
        {"shape": "qwen2-1.5b", "microbatch_tokens": 4096, **QWEN_BATCH},
        {**TOY_BATCH, "microbatch_tokens": 128},
    ),
    Check(
        "learner_step_1.5b_lora", "gpu_model_checks:learner_step", 60, True,
        {"shape": "qwen2-1.5b", "microbatch_tokens": 4096, "lora_rank": 16, **QWEN_BATCH},
        {**TOY_BATCH, "microbatch_tokens": 128, "lora_rank": 4},
    ),
)  # fmt: skip
"""In order of what matters most when the budget runs short."""


# ------------------------------------------------------------------ inside a check


class Skipped(Exception):
    """Raised by a check that cannot run here; its message says why."""


class Figures(dict):
    """A check's figures, written to its result file at every assignment, so that a check
    killed at its cap keeps what it had measured."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __setitem__(self, key: str, value) -> None:
        super().__setitem__(key, value)
        self.save()

    def save(self, **extra) -> None:
        write_json(self.path, {"figures": dict(self), **extra})


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` whole or not at all (a reader never sees half a file)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(partial, path)


def run_child(function: str, options: dict, result: Path, device: str) -> int:
    """Run one check, ``module:function``, in this process (the runner starts it as a
    child); its figures go to ``result``, its output to the runner's log."""
    figures = Figures(result)
    figures.save()
    sys.path.insert(0, str(HERE))  # benchmarks/ is not a package
    module, name = function.split(":")
    try:
        getattr(importlib.import_module(module), name)(figures, device, **options)
    except Skipped as why:
        figures.save(skipped=str(why))
        return 0
    except BaseException as error:
        figures.save(error=f"{type(error).__name__}: {error}")
        traceback.print_exc()
        return 1
    return 0


# ------------------------------------------------------------------ the runner


@dataclass
class Outcome:
    status: str
    """passed, failed, skipped or timeout."""
    seconds: float
    figures: dict
    reason: str | None = None


def launch_child(
    check: Check, device: str, rehearsal: bool, cap_s: float, work: Path, log: Path
) -> Outcome:
    """Run ``check`` in a child process of its own session, killed with everything it
    started when ``cap_s`` runs out; its output goes to ``log``."""
    result = work / f"{check.name}{'.rehearsal' if rehearsal else ''}.json"
    options = (check.rehearsal if rehearsal else check.options) or {}
    command = [sys.executable, str(Path(__file__).resolve()), "--child", check.function]
    command += ["--options", json.dumps(options), "--result", str(result), "--device", device]
    started = time.monotonic()
    with log.open("a") as out:
        kind = " (rehearsal)" if rehearsal else ""
        out.write(f"\n===== {check.name}{kind} on {device}, cap {cap_s:.0f} s, {now()}\n")
        out.flush()
        child = subprocess.Popen(
            command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = child.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            code = None
            stop_session(child)
    seconds = time.monotonic() - started
    written = read_result(result)
    figures = written.get("figures", {})
    if code is None:
        return Outcome("timeout", seconds, figures, f"still running after its cap of {cap_s:.0f} s")
    if code != 0:
        why = written.get("error") or f"exited with {code} ({signal_name(code)}); see the log"
        return Outcome("failed", seconds, figures, why)
    if "skipped" in written:
        return Outcome("skipped", seconds, figures, written["skipped"])
    return Outcome("passed", seconds, figures)


def stop_session(child: subprocess.Popen) -> None:
    """SIGTERM to the child's session (a launcher stops its roles on it), SIGKILL after 10 s."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace)
            return


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def signal_name(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return "error"


def read_result(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


class Runner:
    """Runs the checks in order within the budget and keeps the JSON up to date."""

    def __init__(self, out: Path, budget_s: float, checks=CHECKS, rehearse: bool = True):
        self.out = out
        self.budget_s = budget_s
        self.checks = checks
        self.rehearse = rehearse
        self.started = time.monotonic()
        self.json_path = out / "gpu_check.json"
        self.log = out / "gpu_check.log"
        self.report: dict = {
            "started": now(),
            "finished": None,
            "budget_s": budget_s,
            "gpu": "unknown",
            "checks": [],
        }

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def run(self, setup_failed: str | None = None, setup_s: float | None = None) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        self.add({"name": "setup", "status": "failed" if setup_failed else "passed",
                  "seconds": setup_s, "reason": setup_failed})  # fmt: skip
        cuda = False
        with tempfile.TemporaryDirectory(prefix="asyncrl-gpu-check-") as work:
            for check in self.checks:
                if setup_failed:
                    self.add(entry(check, "skipped", reason="setup failed: see the log"))
                    continue
                device = "auto" if check.name == "device" else "cuda" if cuda else "cpu"
                if check.cuda_only and not cuda:
                    self.skip_and_rehearse(check, Path(work))
                    continue
                if (left := self.left_s()) < MIN_START_S:
                    self.add(entry(check, "skipped", reason=f"{left:.0f} s of the budget left"))
                    continue
                outcome = launch_child(check, device, False, min(check.cap_s, left),
                                       Path(work), self.log)  # fmt: skip
                if check.name == "device":  # failed before it knew: a driver means a GPU
                    cuda = bool(outcome.figures.get("cuda_available", shutil.which("nvidia-smi")))
                    self.report["gpu"] = outcome.figures.get("gpu_name", "unknown")
                    if not cuda and self.rehearse:
                        self.budget_s *= REHEARSAL_FACTOR
                        self.report["budget_s"] = self.budget_s
                self.add(entry(check, outcome.status, outcome, device=device))
        self.report["finished"] = now()
        self.report["elapsed_s"] = round(time.monotonic() - self.started, 1)
        write_json(self.json_path, self.report)
        return self.report

    def skip_and_rehearse(self, check: Check, work: Path) -> None:
        line = entry(check, "skipped", reason=NO_CUDA)
        left = self.left_s()
        if self.rehearse and check.rehearsal is not None and left >= MIN_START_S:
            cap_s = min(check.cap_s * REHEARSAL_FACTOR, left)
            outcome = launch_child(check, "cpu", True, cap_s, work, self.log)
            line["rehearsal"] = {"device": "cpu", "options": check.rehearsal,
                                 **entry(check, outcome.status, outcome)}  # fmt: skip
            for key in ("name", "cap_s"):
                line["rehearsal"].pop(key)
        self.add(line)

    def add(self, line: dict) -> None:
        line.setdefault("gpu", self.report["gpu"])
        self.report["checks"].append(line)
        self.report["elapsed_s"] = round(time.monotonic() - self.started, 1)
        write_json(self.json_path, self.report)
        print(summary_line(line), flush=True)


def entry(
    check: Check, status: str, outcome: Outcome | None = None, reason: str | None = None, **extra
) -> dict:
    """A check's line in the JSON."""
    line = {"name": check.name, "status": status, "cap_s": check.cap_s, **extra}
    if outcome is not None:
        line |= {"seconds": round(outcome.seconds, 1), "figures": outcome.figures}
        reason = reason or outcome.reason
    line["reason"] = reason
    return line


def summary_line(line: dict) -> str:
    text = f"{line['name']:26s} {line['status']:8s}"
    if line.get("seconds") is not None:
        text += f" {line['seconds']:6.1f} s"
    if line.get("reason"):
        text += f"  {line['reason']}"
    if rehearsal := line.get("rehearsal"):
        text += f"  [cpu rehearsal: {rehearsal['status']}, {rehearsal.get('seconds', 0):.1f} s"
        text += f"{': ' + rehearsal['reason'] if rehearsal.get('reason') else ''}]"
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check")
    parser.add_argument("--budget-s", type=float, default=400.0, help="seconds for all checks")
    parser.add_argument("--only", action="append", help="run only this check (repeatable)")
    parser.add_argument("--no-rehearsal", action="store_true", help="no toy runs without CUDA")
    parser.add_argument("--setup-failed", help="what failed while installing (then none runs)")
    parser.add_argument("--setup-s", type=float, help="seconds the installation took")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # module:function of one check
    parser.add_argument("--options", type=json.loads, default={}, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--device", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return run_child(args.child, args.options, args.result, args.device)
    unknown = set(args.only or ()) - {c.name for c in CHECKS}
    if unknown:
        parser.error(f"--only: no check named {sorted(unknown)}; the checks: "
                     f"{[c.name for c in CHECKS]}")  # fmt: skip
    checks = [c for c in CHECKS if not args.only or c.name in args.only or c.name == "device"]
    runner = Runner(args.out, args.budget_s, checks, rehearse=not args.no_rehearsal)
    report = runner.run(args.setup_failed, args.setup_s)
    print(f"wrote {runner.json_path} and {runner.log}")
    failed = [c["name"] for c in report["checks"] if c["status"] in ("failed", "timeout")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.modules.setdefault("gpu_check", sys.modules[__name__])  # the checks import this module
    sys.exit(main())
