"""HFBackend prefills a prefix shared by several rows once (a GRPO group's prompt), and
generates exactly what it generates without the sharing."""

from __future__ import annotations

import pytest
import torch

from asyncrl.generators import hf_backend
from asyncrl.generators.hf_backend import Rollout
from tests.helpers.generators import make_backend, recompute

torch.set_num_threads(1)

GROUP = [1, 3, 4, 5, 13]
OTHER = [1, 6, 13]  # shorter: the group's rows are left-padded beside it


def rollouts() -> list[Rollout]:
    prompts = [GROUP] * 4 + [OTHER] * 2
    return [
        Rollout(group_id=i // 4, sample_index=i, prompt_ids=list(p), ground_truth="x")
        for i, p in enumerate(prompts)
    ]


def test_each_distinct_prefix_is_prefilled_once_and_its_cache_copied_to_its_rows():
    backend = make_backend()
    batch = [r.prompt_ids for r in rollouts()]
    input_ids, attention_mask = backend._left_pad(batch)
    seen = []
    hook = backend.model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True
    )
    try:
        cache = hf_backend.shared_prefill(backend.model, input_ids, attention_mask)
    finally:
        hook.remove()
    assert seen == [torch.Size([2, input_ids.shape[1] - 1])]  # two distinct prompts, once each
    keys = cache.layers[0].keys
    assert keys.shape[0] == len(batch)
    assert torch.equal(keys[0], keys[3]) and torch.equal(keys[4], keys[5])
    assert not torch.equal(keys[0], keys[4])


def test_rows_all_different_are_left_to_generate():
    backend = make_backend()
    input_ids, attention_mask = backend._left_pad([GROUP, OTHER])
    assert hf_backend.shared_prefill(backend.model, input_ids, attention_mask) is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prefill_samples_the_same_tokens_and_log_probs(monkeypatch, temperature):
    results = {}
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(hf_backend, "shared_prefill", lambda *args: None)
        backend = make_backend(temperature)
        group = rollouts()
        torch.manual_seed(7)
        backend.generate_chunk(group, max_tokens=6)
        results[shared] = group
    for with_sharing, without in zip(results[True], results[False], strict=True):
        assert with_sharing.response_ids == without.response_ids
        torch.testing.assert_close(
            torch.tensor(with_sharing.logprobs), torch.tensor(without.logprobs), atol=1e-5, rtol=0
        )


def test_recorded_log_probs_are_the_learner_s_for_rows_that_shared_a_prefill():
    backend = make_backend(0.7)
    group = rollouts()
    torch.manual_seed(3)
    backend.generate_chunk(group, max_tokens=6)
    for rollout in group:
        learner = recompute(backend.model, rollout, 0.7)
        torch.testing.assert_close(torch.tensor(rollout.logprobs), learner, atol=1e-5, rtol=0)
