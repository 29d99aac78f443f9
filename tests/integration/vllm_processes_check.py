"""Run by test_backend_contract.py: the vLLM backend with its engine in spawned processes.

``python tests/integration/vllm_processes_check.py WORK_DIR`` starts the engine
with ``generators.vllm_in_process: false`` (vLLM's default layout: engine core
and worker in processes it spawns, hence the ``__main__`` guard), generates one
chunk, swaps the weights in place through a file, continues, and prints one
JSON line for the test to check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from asyncrl.config import GeneratorsConfig, ModelConfig, TinyModelConfig
from asyncrl.generation.models import build_policy
from asyncrl.generators.backend import Rollout
from asyncrl.learner.algorithms import token_logprobs

CHUNK = 4


@torch.no_grad()
def mismatch(model: torch.nn.Module, rollouts: list[Rollout], start: int) -> float:
    worst = 0.0
    for r in rollouts:
        ids = torch.tensor([r.prompt_ids + r.response_ids])
        expected = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
        expected = expected[len(r.prompt_ids) - 1 :]
        diffs = (torch.tensor(r.logprobs) - expected)[start:].abs()
        worst = max([worst, *diffs.tolist()])
    return worst


def main(work_dir: Path) -> None:
    from asyncrl.generators.vllm_backend import VLLMBackend

    tiny = TinyModelConfig(hidden_size=128, num_heads=2, intermediate_size=256)
    model, tokenizer = build_policy(ModelConfig(tiny=tiny), seed=0)
    sampling = GeneratorsConfig(
        backend="vllm", max_new_tokens=3 * CHUNK, vllm_in_process=False, vllm_kv_cache_gb=0.25
    )
    backend = VLLMBackend.from_model(model, tokenizer, sampling, work_dir)
    try:
        rollouts = [Rollout(0, i, [1, 3 + i % 10, 4, 13], "x") for i in range(8)]
        backend.generate_chunk(rollouts, CHUNK)
        before = mismatch(model, rollouts, 0)
        first = [list(r.response_ids) for r in rollouts]
        new = {name: t * 1.3 for name, t in model.state_dict().items()}
        backend.load_weights(new, version=1)
        model.load_state_dict(new)
        while not all(r.finished for r in rollouts):
            backend.generate_chunk(rollouts, CHUNK)
        result = {
            "mismatch_v0": before,
            "mismatch_v1": mismatch(model, rollouts, CHUNK),
            "prefix_kept": all(
                r.response_ids[: len(f)] == f for r, f in zip(rollouts, first, strict=True)
            ),
            "versions": [r.token_versions for r in rollouts],
            "first_lengths": [len(f) for f in first],
            "load_s": backend.last_load_s,
            "swap_files_left": [str(p) for p in backend._swap_dir.iterdir()],
        }
    finally:
        backend.close()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
