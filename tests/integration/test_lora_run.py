"""`model.lora` end to end: the quickstart on two FSDP2 ranks trains adapters, its
generators load the weights with the adapters folded in, a checkpoint holds the adapters
alone (resuming from one is tested on the learner, tests/unit/learner/test_lora.py), and
the final export loads as a plain model and as peft's adapter on the base."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_processes import processes_of
from torch.distributed.checkpoint import FileSystemReader

from asyncrl.config import load_config
from asyncrl.models import build_policy
from asyncrl.status import read_metrics

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]
LORA = ["model.lora.rank=8", "learner.world_size=2", "tracking.aim=false"]


def launch(*arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "asyncrl", "launch", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)


def test_a_lora_run_on_two_ranks_syncs_checkpoints_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    quickstart = str(REPO / "configs/quickstart.yaml")
    first = launch(
        quickstart, *LORA, "run.total_steps=6", "learner.checkpoint_every=3",
        "--run-dir", str(run_dir),
    )  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    saved = run_dir / "checkpoints" / "step-000006"
    assert (saved / "COMPLETE").exists()
    # the adapters and their optimizer state only, on both ranks' shards
    keys = FileSystemReader(saved).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all("lora_A" in k or "lora_B" in k for k in weights), weights

    records = read_metrics(run_dir)
    assert [r["version"] for r in records] == list(range(1, 7))
    assert records[-1]["generators_weights_loads_shm_total"] >= 1  # the merged weights
    assert records[-1].get("generators_weights_transfer_failures_total", 0.0) == 0.0

    final = run_dir / "final"
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8
    config = load_config(run_dir / "config.yaml")
    base, _ = build_policy(config.model, config.run.seed)  # the tiny model, as it started
    tokens = torch.arange(3, 15)[None]
    with torch.no_grad():
        before = base(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(final).eval()(input_ids=tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, final / "adapter").eval()
        unmerged = adapted(input_ids=tokens).logits
    assert not torch.allclose(before, merged)  # the run trained the adapters
    torch.testing.assert_close(unmerged, merged, rtol=1e-4, atol=1e-5)
    assert processes_of(run_dir) == [], "the launcher left processes behind"
