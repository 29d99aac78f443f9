"""The FSDP2 learner across processes: 2 ranks match 1; a resumed run matches an unbroken one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = "tests.integration.fsdp_worker"  # run as a module from REPO: it imports tests.helpers
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def train(out: Path, steps: int, *args: str, ranks: int = 1) -> dict:
    """Run the worker under torchrun; returns rank 0's ``{"params", "metrics"}``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*launcher, f"--nproc-per-node={ranks}", "-m", WORKER, str(out), str(steps), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=200, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return torch.load(out / "params.pt", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.mark.parametrize(
    "overrides",
    [
        # pre-pass on both ranks: values (critic), reference log-probs, proximal log-probs.
        # GRPO alone on 2 ranks is the path of test_resume_matches_an_unbroken_run below
        # and of test_launch_end_to_end's torchrun run, so it is not run a third time here.
        ["algorithm.advantage=gae", "algorithm.kl_coef=0.05", "learner.minibatches=2"],
    ],
    ids=["gae-kl-minibatches"],
)
def test_two_ranks_match_one(tmp_path, overrides):
    """Same data, same seed: sharding over 2 gloo ranks changes nothing but rounding."""
    one = train(tmp_path / "one", 4, *overrides, ranks=1)
    two = train(tmp_path / "two", 4, *overrides, ranks=2)
    initial = train(tmp_path / "zero", 0, *overrides, ranks=1)
    assert max_difference(one["params"], initial["params"]) > 1e-3  # it did train
    assert max_difference(one["params"], two["params"]) < 1e-4
    for key in ("loss_policy", "learner_grad_norm", "learner_entropy"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6)
    # A generator rebuilding the weights the 2 ranks published (in 4 KiB chunks) gets
    # exactly the learner's tensors, under the Hugging Face names; the LM head, tied to
    # the embedding, is sent once, as the embedding.
    assert set(two["params"]) - set(two["rebuilt"]) == {"lm_head.weight"}
    assert "model.embed_tokens.weight" in two["rebuilt"]
    sent = {name: two["params"][name] for name in two["rebuilt"]}
    assert max_difference(two["rebuilt"], sent) == 0.0


def test_resume_matches_an_unbroken_run(tmp_path):
    """Checkpoint at step 2 of 4, resume from it in fresh processes: identical parameters."""
    unbroken = train(tmp_path / "unbroken", 4, "--save-at", "2", ranks=2)
    checkpoint = tmp_path / "unbroken" / "checkpoint"
    assert (checkpoint / "COMPLETE").exists()
    resumed = train(tmp_path / "resumed", 4, "--resume", str(checkpoint), ranks=2)
    assert max_difference(unbroken["params"], resumed["params"]) == 0.0
    assert resumed["metrics"]["learner_lr"] == unbroken["metrics"]["learner_lr"]


def test_a_gguf_policy_checkpoints_and_exports_like_any_other(tmp_path, smollm2_gguf):
    """model.name_or_path naming a .gguf file (SmolLM2-135M-Instruct, dequantized on
    load): the step-1 checkpoint is written whole, and the final export is a plain
    Hugging Face folder holding exactly the trained weights. (Resuming from a checkpoint
    does not depend on where the weights first came from: test_resume_matches_an_unbroken_run
    resumes one on two ranks; a second load of the 135M GGUF file here cost a minute of CI.)"""
    from transformers import AutoModelForCausalLM

    source = [f"model.name_or_path={smollm2_gguf}", "model.tiny=null", "learner.lr=1e-4"]
    source += ["--no-publish"]
    unbroken = train(tmp_path / "unbroken", 1, *source, "--save-at", "1", "--export")
    checkpoint = tmp_path / "unbroken" / "checkpoint"
    assert (checkpoint / "COMPLETE").exists()

    final = tmp_path / "unbroken" / "final"
    assert "quantization_config" not in (final / "config.json").read_text()
    exported = AutoModelForCausalLM.from_pretrained(final).state_dict()
    params = unbroken["params"]
    assert max_difference({name: exported[name] for name in params}, params) == 0.0
