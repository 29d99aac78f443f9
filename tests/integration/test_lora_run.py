"""`model.lora` end to end: the quickstart on two FSDP2 ranks trains adapters, its
generators load the adapters alone over each path, a checkpoint holds the adapters alone
(resuming from one is tested on the learner, tests/unit/learner/test_lora.py), the final
export loads as a plain model and as peft's adapter on the base, and a replica that never
applies its adapters has its samples refused, not trained on."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from asyncrl.config import load_config
from asyncrl.generation import lora
from asyncrl.generation.models import build_policy
from asyncrl.run.status import read_metrics
from tests.helpers.faults import keep_base_env
from tests.helpers.run_processes import processes_of

pytestmark = pytest.mark.slow
peft = pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]
LORA = ["model.lora.rank=8", "learner.world_size=2", "tracking.aim=false"]


def launch(*arguments: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "asyncrl", "launch", *arguments]
    environment = {**os.environ, **(env or {})}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=REPO, env=environment
    )


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
    assert records[-1]["generators_weights_loads_shm_total"] >= 1  # the adapters alone
    assert records[-1]["buffer_refused_adapter"] == 0.0  # every replica applied each one
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


@pytest.mark.parametrize("transport", ["zmq", "collective"])
def test_adapters_alone_go_over_the_other_paths(tmp_path, transport):
    run_dir = tmp_path / "run"
    quickstart = str(REPO / "configs/quickstart.yaml")
    done = launch(
        quickstart, "model.lora.rank=8", "tracking.aim=false", "run.total_steps=4",
        f"weights.transport={transport}", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    last = read_metrics(run_dir)[-1]
    assert last["generators_weight_swaps_total"] >= 1, last
    assert last.get("generators_weights_transfer_failures_total", 0.0) == 0.0
    assert last["buffer_refused_adapter"] == 0.0
    if transport == "collective":  # the chain: collective, then zmq
        assert last["generators_weights_loads_collective_total"] >= 1, last
    else:  # each transfer is the adapters' bytes, not the model's
        config = load_config(run_dir / "config.yaml")
        model, _ = build_policy(config.model, config.run.seed)
        adapters = lora.inject_adapters(model, config.model.lora).state_dict().values()
        size = sum(t.numel() * t.element_size() for t in adapters)
        assert last["weights_transfers_finished_total"] >= 1
        assert last["weights_bytes_sent_total"] == last["weights_transfers_finished_total"] * size


def test_a_replica_that_keeps_the_base_model_has_its_samples_refused(tmp_path):
    env, trigger = keep_base_env(tmp_path / "fault")
    run_dir = tmp_path / "run"
    quickstart = str(REPO / "configs/quickstart.yaml")
    done = launch(
        quickstart, "model.lora.rank=8", "tracking.aim=false", "run.total_steps=6",
        "--run-dir", str(run_dir), env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert Path(f"{trigger}.taken").exists()  # one of the two replicas kept the base
    last = read_metrics(run_dir)[-1]
    assert last["buffer_refused_adapter"] > 0, last  # its samples past v0, every one
    assert last["buffer_requeued_groups"] > 0  # and their groups went out again
    assert last["version"] == 6  # the healthy replica's samples trained the run
    assert processes_of(run_dir) == [], "the launcher left processes behind"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no vllm")
def test_vllm_generators_serve_each_version_s_adapter_with_the_learner_s_logprobs(tmp_path):
    run_dir = tmp_path / "run"
    done = launch(
        str(REPO / "configs/quickstart_vllm.yaml"), "model.lora.rank=8", "tracking.aim=false",
        "run.total_steps=6", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    records = read_metrics(run_dir)
    last = records[-1]
    assert last["generators_weight_swaps_total"] >= 1, last
    assert last["buffer_refused_adapter"] == 0.0
    mismatch = [r["logprob_mismatch"] for r in records if r["logprob_mismatch"] is not None]
    assert mismatch and max(mismatch) < 1e-4, mismatch  # vLLM's LoRA forward is the learner's
    log = (run_dir / "logs" / "generator-0.log").read_text()
    assert "loaded weights v" in log
    assert processes_of(run_dir) == [], "the launcher left processes behind"
