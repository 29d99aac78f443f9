"""LoRA adapters published alone, applied by each engine: HF (peft's layers on its copy of
the base) and vLLM (its own LoRA support, one ``LoRARequest`` per version). The log-probs
each records are the learner's (peft's forward) for the same tokens and adapter; each
reports the digest of the adapter it serves; vLLM holds one adapter however many versions
go by. Measured differences print with ``-s``."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.config import GeneratorsConfig, LoraConfig
from asyncrl.core.messages import BASE_DIGEST
from asyncrl.generation import lora
from asyncrl.generation.models import build_policy
from asyncrl.learner.algorithms.logprobs import token_logprobs
from tests.helpers.engines import BLOCK, ENGINES, MODEL, make_rollouts, run_to_completion

peft = pytest.importorskip("peft")

ADAPTERS = LoraConfig(rank=8, alpha=16)
TOLERANCE = {"hf": 1e-5, "vllm": 2e-3}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tmp_path_factory):
    model, tokenizer = build_policy(MODEL, seed=0)
    sampling = GeneratorsConfig(
        backend=request.param, chunk_tokens=4, max_new_tokens=12, max_active_samples=64
    )
    if request.param == "hf":
        from asyncrl.generators.hf_backend import HFBackend

        backend = HFBackend(copy.deepcopy(model), tokenizer, sampling, adapters=ADAPTERS)
    else:
        from asyncrl.generators.vllm_backend import VLLMBackend

        backend = VLLMBackend.from_model(
            copy.deepcopy(model), tokenizer, sampling, tmp_path_factory.mktemp("vllm"),
            seed=0, block_size=BLOCK, adapters=ADAPTERS,
        )  # fmt: skip
    reference = lora.with_adapters(model, ADAPTERS, seed=0).eval()  # the learner's forward
    try:
        yield request.param, backend, reference
    finally:
        backend.close()


def new_adapters(reference, seed: int) -> dict[str, torch.Tensor]:
    """Random adapters (B too, so they change the model) set on ``reference``; published."""
    generator = torch.Generator().manual_seed(seed)
    published = {}
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if lora.is_adapter(name):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
                published[lora.published_name(name.removeprefix(lora.PEFT_PREFIX))] = (
                    parameter.detach().clone()
                )
    return published


@torch.no_grad()
def mean_difference(reference, rollouts) -> float:
    diffs = []
    for rollout in rollouts:
        ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
        logits = reference(input_ids=ids).logits
        ours = token_logprobs(logits[:, :-1], ids[:, 1:], 1.0)[0][len(rollout.prompt_ids) - 1 :]
        diffs.append((torch.tensor(rollout.logprobs) - ours).abs())
    return torch.cat(diffs).mean().item()


def test_each_engine_applies_the_published_adapter_and_reports_its_digest(engine):
    name, backend, reference = engine
    assert backend.adapter_digest == BASE_DIGEST  # no adapter yet: the base model
    for version, seed in ((1, 11), (2, 12), (3, 13)):
        published = new_adapters(reference, seed)
        backend.load_weights(published, version)
        assert backend.version == version
        assert backend.adapter_digest == lora.adapter_digest(published.items())
        rollouts = make_rollouts(8)
        run_to_completion(backend, rollouts)
        assert all(v == version for r in rollouts for v in r.token_versions)
        difference = mean_difference(reference, rollouts)
        print(f"\n[{name}] LoRA v{version}: |behaviour - learner| log-prob mean {difference:.2e}")
        assert difference < TOLERANCE[name]
        with reference.disable_adapter():  # the base model: the adapter made a difference
            assert mean_difference(reference, rollouts) > 10 * TOLERANCE[name]
        if name == "vllm":  # one adapter resident, the version's; older folders gone
            assert backend.list_adapters() == {version + 1}
            assert sorted(p.name for p in backend._adapter_dir.iterdir()) == [f"v{version}"]


def test_an_adapter_of_another_layout_is_refused_before_anything_changes(engine):
    _, backend, reference = engine
    held, digest = backend.version, backend.adapter_digest
    published = new_adapters(reference, 21)
    first = next(iter(published))
    wrong = dict(published)
    del wrong[first]
    with pytest.raises(ValueError, match="missing"):
        backend.load_weights(wrong, held + 1)
    assert (backend.version, backend.adapter_digest) == (held, digest)
