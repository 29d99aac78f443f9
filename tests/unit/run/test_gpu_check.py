"""The GPU check's runner keeps every figure when a check fails, hangs or cannot run, and its
model checks measure the real shapes, on the CPU here (the CUDA run is the GPU's)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.scripts import benchmark

ROOT = Path(__file__).resolve().parents[3]
gpu_check = benchmark("gpu_check")
gpu_model_checks = benchmark("gpu_model_checks")
MIN_START_S, NO_CUDA, Check = gpu_check.MIN_START_S, gpu_check.NO_CUDA, gpu_check.Check
Figures, Runner = gpu_check.Figures, gpu_check.Runner

FAKE_CHECKS = """
import time
from gpu_check import Skipped

def device(figures, device):
    figures["cuda_available"] = False
    figures["gpu_name"] = "none"

def measure(figures, device, value):
    figures["value"] = value
    figures["device"] = device

def boom(figures, device):
    figures["partial"] = 2
    raise RuntimeError("broke after measuring")

def hang(figures, device):
    figures["before"] = 3
    time.sleep(120)

def nothing(figures, device):
    raise Skipped("nothing to do here")
"""


def fake(name: str, function: str, cap_s: float = 60, cuda_only: bool = False, **kw) -> Check:
    return Check(name, f"fake_gpu_checks:{function}", cap_s, cuda_only, **kw)


@pytest.mark.slow
def test_a_failing_a_hanging_and_a_skipped_check_lose_none_of_the_figures(tmp_path, monkeypatch):
    (tmp_path / "fake_gpu_checks.py").write_text(FAKE_CHECKS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the checks' children find the module
    checks = (
        fake("device", "device"),
        fake("boom", "boom"),
        fake("hang", "hang", cap_s=3),
        fake("nothing", "nothing"),
        fake("gpu_only", "measure", cuda_only=True, options={"value": 1},
             rehearsal={"value": 0}),
        fake("after", "measure", options={"value": 5}),
    )  # fmt: skip
    report = Runner(tmp_path / "out", budget_s=200, checks=checks).run()

    by_name = {line["name"]: line for line in report["checks"]}
    assert [line["name"] for line in report["checks"]] == ["setup", *(c.name for c in checks)]
    assert by_name["boom"]["status"] == "failed"
    assert by_name["boom"]["figures"] == {"partial": 2}
    assert by_name["boom"]["reason"] == "RuntimeError: broke after measuring"
    assert by_name["hang"]["status"] == "timeout" and by_name["hang"]["figures"] == {"before": 3}
    assert by_name["nothing"]["status"] == "skipped"
    assert by_name["nothing"]["reason"] == "nothing to do here"
    gpu_only = by_name["gpu_only"]
    assert gpu_only["status"] == "skipped" and gpu_only["reason"] == NO_CUDA
    assert gpu_only["rehearsal"]["status"] == "passed"
    assert gpu_only["rehearsal"]["figures"] == {"value": 0, "device": "cpu"}
    assert by_name["after"]["status"] == "passed"
    assert by_name["after"]["figures"] == {"value": 5, "device": "cpu"}
    assert {line["gpu"] for line in report["checks"][1:]} == {"none"}
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text()) == report
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "RuntimeError: broke after measuring" in log  # the traceback, for the reader


def test_no_check_starts_once_the_budget_is_spent(tmp_path):
    checks = (fake("device", "device"), fake("after", "measure"))
    report = Runner(tmp_path, budget_s=MIN_START_S - 1, checks=checks).run()
    assert [line["status"] for line in report["checks"]] == ["passed", "skipped", "skipped"]
    assert report["checks"][2]["reason"].endswith("s of the budget left")


def test_a_failed_setup_is_reported_and_skips_every_check(tmp_path):
    checks = (fake("device", "device"), fake("after", "measure"))
    report = Runner(tmp_path, budget_s=100, checks=checks).run(setup_failed="no wheels")
    assert report["checks"][0] == {"name": "setup", "status": "failed", "seconds": None,
                                   "reason": "no wheels", "gpu": "unknown"}  # fmt: skip
    assert {line["reason"] for line in report["checks"][1:]} == {"setup failed: see the log"}


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA A10G", None),  # not in the table: no MFU rather than a wrong one
    ],
)
def test_the_bf16_peak_comes_from_the_device_name(name, peak):
    assert gpu_model_checks.bf16_peak_tflops(name) == peak


@pytest.mark.parametrize(
    ("shape", "parameters"), [("qwen2-0.5b", 494_032_768), ("qwen2-1.5b", 1_543_714_304)]
)
def test_the_qwen2_shapes_give_the_real_models_parameter_counts(shape, parameters):
    model = gpu_model_checks.qwen2_model(shape, "meta", torch.float32)  # no memory
    assert gpu_model_checks.parameters(model) == parameters  # Qwen2.5's, tied embedding once


@pytest.fixture
def own_environment():
    """The process group's variables (RANK, WORLD_SIZE, ...) do not outlive the test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_the_learner_step_check_runs_the_learners_step_on_a_toy_model(tmp_path, own_environment):
    figures = Figures(tmp_path / "result.json")
    gpu_model_checks.learner_step(figures, "cpu", "toy", rows=8, seq_len=16,
                                  microbatch_tokens=64, steps=1)  # fmt: skip
    written = json.loads((tmp_path / "result.json").read_text())["figures"]
    assert written["batch"]["tokens"] == 128 and written["tokens_per_s"] > 0
    assert written["model"]["parameters"] == sum(
        p.numel() for p in gpu_model_checks.qwen2_model("toy", "meta", torch.float32).parameters()
    )
    assert abs(written["loss_policy"]) < 10 and written["grad_norm"] > 0
    assert "mfu" not in written  # CUDA only


def test_each_gpu_test_outcome_is_saved_as_it_is_known(tmp_path):
    from types import SimpleNamespace

    import gpu_run_checks

    def report(test, when, outcome, longrepr=None):
        return SimpleNamespace(nodeid=test, when=when, duration=0.5, longrepr=longrepr,
                               longreprtext=f"{test} broke", failed=outcome == "failed",
                               skipped=outcome == "skipped")  # fmt: skip

    recorder = gpu_run_checks.OutcomeRecorder(Figures(tmp_path / "result.json"))
    for line in [
        report("a", "setup", "passed"), report("a", "call", "passed"),
        report("b", "setup", "skipped", ("x.py", 1, "Skipped: needs a CUDA GPU")),
        report("c", "call", "failed"),
        report("d", "call", "passed"), report("d", "teardown", "failed"),
    ]:  # fmt: skip
        recorder.pytest_runtest_logreport(line)
    saved = json.loads((tmp_path / "result.json").read_text())["figures"]
    outcomes = {t["test"]: (t["outcome"], t["message"]) for t in saved["tests"]}
    assert outcomes == {
        "a": ("passed", ""),
        "b": ("skipped", "Skipped: needs a CUDA GPU"),
        "c": ("failed", "call: c broke"),
        "d": ("failed", "teardown: d broke"),  # its call passed; its clean-up did not
    }
    assert saved["counts"] == {"passed": 1, "failed": 2, "skipped": 1}
