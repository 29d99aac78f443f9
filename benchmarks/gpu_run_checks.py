"""The GPU check's whole-program checks (``gpu_check.py`` runs each in a process of its own):
``tests/gpu`` under pytest, and the quickstart launched as a user launches it, with the
learner and one HF generator on the GPU, synchronous and asynchronous side by side.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from gpu_check import REPO, Figures, Skipped

QUICKSTART = REPO / "configs" / "quickstart.yaml"
TEST_TIMEOUT_S = 120
"""Per test (pytest-timeout); the check's own cap bounds them all."""
STALENESS = 1
"""``buffer.max_staleness`` of the asynchronous run, the quickstart's own."""


def gpu_tests(figures: Figures, device: str) -> None:
    """``pytest tests/gpu`` in this process: each test's outcome, seconds and message, saved
    as it finishes (a test that hangs past the check's cap leaves the others' outcomes)."""
    import pytest

    recorder = OutcomeRecorder(figures)
    arguments = ["tests/gpu", "-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT_S}"]
    code = int(pytest.main(arguments, plugins=[recorder]))
    tests = list(recorder.tests.values())
    figures["pytest_exit_code"] = code
    if code not in (0, 5) or recorder.counts()["failed"]:  # 5: nothing collected
        raise AssertionError(f"pytest tests/gpu exited with {code}: {recorder.counts()}")
    if not tests:
        raise AssertionError("pytest tests/gpu ran no test")
    if not recorder.counts()["passed"]:
        reasons = sorted({t["message"] for t in tests})
        raise Skipped(f"every test was skipped: {'; '.join(reasons)}")


class OutcomeRecorder:
    """A pytest plugin: each test's outcome into ``figures["tests"]`` as it is known."""

    def __init__(self, figures: Figures):
        self.figures = figures
        self.tests: dict[str, dict] = {}

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # a module that cannot be imported: its tests never run
            self.record(report.nodeid, "failed", 0.0, f"collection: {report.longreprtext}")

    def pytest_runtest_logreport(self, report) -> None:
        seen = self.tests.get(report.nodeid, {})
        if report.failed:
            message = f"{report.when}: {report.longreprtext}"
            self.record(report.nodeid, "failed", report.duration, message)
        elif report.skipped and report.when in ("setup", "call"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            self.record(report.nodeid, "skipped", report.duration, reason)
        elif report.when == "call" and seen.get("outcome") != "failed":
            self.record(report.nodeid, "passed", report.duration, "")

    def record(self, test: str, outcome: str, seconds: float, message: str) -> None:
        self.tests[test] = {"test": test, "outcome": outcome, "seconds": round(seconds, 2),
                            "message": message[-800:]}  # fmt: skip
        self.figures["tests"] = list(self.tests.values())  # saved at once
        self.figures["counts"] = self.counts()

    def counts(self) -> dict[str, int]:
        outcomes = [t["outcome"] for t in self.tests.values()]
        return {o: outcomes.count(o) for o in ("passed", "failed", "skipped")}


def quickstart(figures: Figures, device: str, steps: int, skip_frac: float = 0.25) -> None:
    """``configs/quickstart.yaml`` twice, synchronous then asynchronous (``max_staleness``
    0, then :data:`STALENESS`), ``steps`` steps each, one generator replica, the learner
    and the replica on ``device``: samples/s of each, their ratio, the learner's wait share.
    """
    import async_vs_sync
    import common

    shared = [f"run.total_steps={steps}", "generators.replicas=1", "tracking.aim=false",
              f"learner.device={device}"]  # fmt: skip
    if device == "cuda":  # the replica's pool asks for a GPU: it generates there
        shared.append("generators.num_gpus=0.5")
    figures["settings"] = {"config": str(QUICKSTART.relative_to(REPO)), "overrides": shared,
                           "skip_frac": skip_frac}  # fmt: skip
    runs = {}
    with tempfile.TemporaryDirectory(prefix="asyncrl-gpu-quickstart-") as work:
        for mode in ("sync", "async"):
            overrides = shared + async_vs_sync.mode_overrides(mode, STALENESS)
            try:
                result = common.launch(QUICKSTART, overrides, Path(work) / mode)
            finally:
                print_launch_log(Path(work) / f"{mode}.launch.log")
            summary = async_vs_sync.summarize(result, skip_frac)
            runs[mode] = summary
            figures[mode] = {
                key: summary[key]
                for key in ("samples_per_s", "step_s", "wait_s", "update_s", "publish_stall_s",
                            "staleness_mean", "reward_last10", "launch_s")
            } | {"learner_wait_share": summary["wait_s"] / summary["step_s"]}  # fmt: skip
    comparison = async_vs_sync.compare(runs["sync"], runs["async"])
    figures["samples_ratio"] = comparison["samples_ratio"]
    figures["ideal_ratio_phases"] = comparison["ideal_ratio_phases"]
    figures["comparison"] = comparison


def print_launch_log(path: Path, lines: int = 40) -> None:
    """The end of a launch's own log, into this check's (the run dir goes with the check)."""
    if path.exists():
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {path.name} (last {len(tail)} lines)", *tail, sep="\n", flush=True)
