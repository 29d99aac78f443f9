"""HFBackend: chunked generation, recorded log-probs, partial rollouts across weight swaps."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import GeneratorsConfig, ModelConfig, TinyModelConfig
from asyncrl.generation.models import build_policy
from asyncrl.generators.hf_backend import HFBackend, Rollout
from tests.helpers.engines import run_to_completion
from tests.helpers.generators import CHUNK, MAX_NEW, make_backend, recompute

torch.set_num_threads(1)

# different prompt lengths, so generation left-pads some rows
PROMPTS = [[1, 3, 4, 5, 13], [1, 6, 13], [1, 7, 8, 9, 10, 11, 13]]


def make_rollouts() -> list[Rollout]:
    return [
        Rollout(group_id=0, sample_index=i, prompt_ids=list(p), ground_truth="x")
        for i, p in enumerate(PROMPTS)
    ]


def bias_eos(backend: HFBackend, amount: float):
    """Shift the EOS logit by ``amount`` in every forward pass (a hook on the LM head)."""
    eos = backend.tokenizer.eos_token_id

    def hook(module, inputs, output):
        output = output.clone()
        output[..., eos] += amount
        return output

    return backend.model.lm_head.register_forward_hook(hook)


def generate_to_completion(backend: HFBackend, rollouts: list[Rollout]) -> list[list[int]]:
    """Run chunks of this file's size until every rollout is finished."""
    return run_to_completion(backend, rollouts, chunk=CHUNK)


def test_a_chunk_extends_each_rollout_by_at_most_the_chunk_size():
    backend = make_backend()
    rollouts = make_rollouts()
    bias = bias_eos(backend, -30.0)  # no EOS: every rollout runs to max_new_tokens
    try:
        torch.manual_seed(0)
        growth = generate_to_completion(backend, rollouts)
    finally:
        bias.remove()
    # 8 tokens in chunks of 3: 3 + 3 + 2
    assert growth == [[3, 3, 3], [3, 3, 3], [2, 2, 2]]
    for rollout in rollouts:
        assert len(rollout.response_ids) == MAX_NEW
        assert len(rollout.logprobs) == MAX_NEW
        assert rollout.token_versions == [0] * MAX_NEW


def test_a_chunk_with_a_smaller_max_tokens_extends_by_that_many():
    backend = make_backend()
    rollouts = make_rollouts()
    bias = bias_eos(backend, -30.0)
    try:
        torch.manual_seed(0)
        backend.generate_chunk(rollouts, 1)
    finally:
        bias.remove()
    assert [len(r.response_ids) for r in rollouts] == [1, 1, 1]
    assert not any(r.finished for r in rollouts)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_the_learners_recomputation(temperature):
    backend = make_backend(temperature)
    rollouts = make_rollouts()
    torch.manual_seed(0)
    generate_to_completion(backend, rollouts)
    for rollout in rollouts:
        recorded = torch.tensor(rollout.logprobs)
        expected = recompute(backend.model, rollout, temperature)
        assert recorded.shape == expected.shape
        torch.testing.assert_close(recorded, expected, atol=1e-4, rtol=0)


def test_recorded_logprobs_at_a_lower_temperature_differ_from_the_temperature_one_distribution():
    backend = make_backend(0.7)
    rollouts = make_rollouts()
    torch.manual_seed(0)
    generate_to_completion(backend, rollouts)
    recorded = torch.tensor(rollouts[0].logprobs)
    at_one = recompute(backend.model, rollouts[0], 1.0)
    assert (recorded - at_one).abs().max().item() > 1e-3


def test_recorded_logprobs_ignore_the_models_own_generation_defaults():
    model, tokenizer = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    # what a model from the Hub may ship in generation_config.json
    model.generation_config.top_k = 3
    model.generation_config.repetition_penalty = 1.5
    sampling = GeneratorsConfig(max_new_tokens=MAX_NEW, chunk_tokens=CHUNK, temperature=1.0)
    backend = HFBackend(model, tokenizer, sampling)
    rollouts = make_rollouts()
    torch.manual_seed(0)
    generate_to_completion(backend, rollouts)
    for rollout in rollouts:
        recorded = torch.tensor(rollout.logprobs)
        torch.testing.assert_close(
            recorded, recompute(backend.model, rollout, 1.0), atol=1e-4, rtol=0
        )


def test_a_rollout_that_samples_eos_stops_with_reason_stop():
    backend = make_backend()
    rollouts = make_rollouts()
    eos = backend.tokenizer.eos_token_id
    bias = bias_eos(backend, 30.0)  # EOS is all but certain
    try:
        torch.manual_seed(0)
        backend.generate_chunk(rollouts, CHUNK)
    finally:
        bias.remove()
    for rollout in rollouts:
        assert rollout.response_ids == [eos]
        assert rollout.finish_reason == "stop"
        assert rollout.finished
        assert len(rollout.logprobs) == 1
        assert rollout.token_versions == [0]


def test_a_rollout_without_eos_stops_at_max_new_tokens_with_reason_length():
    backend = make_backend()
    rollouts = make_rollouts()
    bias = bias_eos(backend, -30.0)
    try:
        torch.manual_seed(0)
        generate_to_completion(backend, rollouts)
    finally:
        bias.remove()
    assert [r.finish_reason for r in rollouts] == ["length"] * 3
    assert all(backend.tokenizer.eos_token_id not in r.response_ids for r in rollouts)


def test_finished_rollouts_are_left_untouched():
    backend = make_backend()
    done = Rollout(
        0,
        0,
        [1, 3, 13],
        "x",
        response_ids=[4, 2],
        logprobs=[-1.0, -2.0],
        token_versions=[0, 0],
        finish_reason="stop",
    )
    running = Rollout(0, 1, [1, 5, 13], "x")
    torch.manual_seed(0)
    backend.generate_chunk([done, running], CHUNK)
    assert done.response_ids == [4, 2]
    assert done.logprobs == [-1.0, -2.0]
    assert len(running.response_ids) >= 1


def perturbed(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # a deterministic function of each tensor, so tied entries stay identical
    return {name: tensor * 1.5 + 0.05 for name, tensor in state_dict.items()}


def test_a_partial_rollout_switches_versions_at_the_chunk_boundary_without_regenerating():
    backend = make_backend()
    old_backend = make_backend()  # the same version-0 weights, never updated
    rollouts = make_rollouts()
    # keep every rollout running past the first chunk; the recomputations below see the same bias
    hooks = [bias_eos(backend, -30.0), bias_eos(old_backend, -30.0)]
    try:
        torch.manual_seed(0)
        backend.generate_chunk(rollouts, CHUNK)
        first_tokens = [list(r.response_ids) for r in rollouts]
        first_logprobs = [list(r.logprobs) for r in rollouts]
        assert all(len(t) == CHUNK for t in first_tokens)

        backend.load_weights(perturbed(backend.model.state_dict()), version=1)
        assert backend.version == 1
        generate_to_completion(backend, rollouts)

        for rollout, tokens, logprobs in zip(rollouts, first_tokens, first_logprobs, strict=True):
            later = len(rollout.response_ids) - CHUNK
            assert later == MAX_NEW - CHUNK
            assert rollout.token_versions == [0] * CHUNK + [1] * later
            # the first chunk is kept as it was generated, not regenerated
            assert rollout.response_ids[:CHUNK] == tokens
            assert rollout.logprobs[:CHUNK] == logprobs

            recorded = torch.tensor(rollout.logprobs)
            new = recompute(backend.model, rollout, 1.0)
            old = recompute(old_backend.model, rollout, 1.0)
            # version-1 tokens carry the new weights' log-probs, version-0 tokens the old ones'
            torch.testing.assert_close(recorded[CHUNK:], new[CHUNK:], atol=1e-4, rtol=0)
            torch.testing.assert_close(recorded[:CHUNK], old[:CHUNK], atol=1e-4, rtol=0)
            # and the swap really changed the distribution
            assert (recorded[:CHUNK] - new[:CHUNK]).abs().max().item() > 1e-3
    finally:
        for hook in hooks:
            hook.remove()


def test_load_weights_with_a_missing_tensor_raises_value_error():
    backend = make_backend()
    state_dict = perturbed(backend.model.state_dict())
    missing = "model.norm.weight"
    del state_dict[missing]
    with pytest.raises(ValueError, match=missing):
        backend.load_weights(state_dict, version=1)
    assert backend.version == 0


def test_load_weights_with_an_extra_tensor_raises_value_error():
    backend = make_backend()
    state_dict = dict(backend.model.state_dict())
    state_dict["model.surprise.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="surprise"):
        backend.load_weights(state_dict, version=1)
    assert backend.version == 0


def test_load_weights_without_the_tied_lm_head_is_accepted():
    backend = make_backend()
    assert backend.model.config.tie_word_embeddings
    state_dict = perturbed(backend.model.state_dict())
    state_dict.pop("lm_head.weight", None)
    backend.load_weights(state_dict, version=2)
    assert backend.version == 2
    assert torch.equal(backend.model.model.norm.weight, state_dict["model.norm.weight"])


def test_a_rejected_state_dict_leaves_the_loaded_weights_unchanged():
    backend = make_backend()
    before = {name: t.clone() for name, t in backend.model.state_dict().items()}
    state_dict = perturbed(backend.model.state_dict())
    del state_dict["model.norm.weight"]
    with pytest.raises(ValueError):
        backend.load_weights(state_dict, version=1)
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_tensor_of_the_wrong_shape_is_refused_before_any_weight_changes():
    backend = make_backend()
    before = {name: t.clone() for name, t in backend.model.state_dict().items()}
    state_dict = perturbed(backend.model.state_dict())
    state_dict["model.norm.weight"] = state_dict["model.norm.weight"][:1]  # would broadcast
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        backend.load_weights(state_dict, version=1)
    assert backend.version == 0
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_weights_loaded_in_parts_hold_the_new_version_only_after_the_last_part():
    backend = make_backend()
    state_dict = perturbed(backend.model.state_dict())
    names = list(state_dict)
    seen_versions = []

    def parts():
        for start in range(0, len(names), 3):
            seen_versions.append(backend.version)
            yield {name: state_dict[name] for name in names[start : start + 3]}

    backend.load_weights_in_parts(names, parts(), version=4)
    assert seen_versions and set(seen_versions) == {0} and backend.version == 4
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, state_dict[name]), name


def test_loading_in_parts_checks_every_name_before_the_first_part():
    backend = make_backend()
    state_dict = perturbed(backend.model.state_dict())
    names = [name for name in state_dict if name != "model.norm.weight"]
    consumed = []

    def parts():
        consumed.append(True)
        yield state_dict

    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        backend.load_weights_in_parts(names, parts(), version=1)
    assert not consumed and backend.version == 0


def offer_buckets(state_dict: dict[str, torch.Tensor], skip: set[str]):
    """The collective path's buckets for ``state_dict`` as the shm slot lays it out."""
    from asyncrl.core.messages import TensorEntry
    from asyncrl.weights.collective.buckets import plan_slot_buckets
    from asyncrl.weights.shm.segment import aligned_layout

    names = [name for name in state_dict if name not in skip]
    entries: list[TensorEntry] = aligned_layout(
        [(name, "float32", tuple(state_dict[name].shape)) for name in names]
    )
    return [bucket for bucket, _ in plan_slot_buckets(entries, 4096)]


def test_weight_buffers_are_the_models_tensors_so_bytes_written_there_are_loaded():
    backend = make_backend()
    before = {name: t.clone() for name, t in backend.model.state_dict().items()}
    buckets = offer_buckets(before, {"lm_head.weight"})  # tied: the embedding carries it
    flats = backend.weight_buffers(buckets)
    assert flats is not None and len(flats) == len(buckets) > 1
    for name, tensor in backend.model.state_dict().items():  # moved, not changed
        assert torch.equal(tensor, before[name]), name
    assert backend.weight_buffers(buckets) is flats  # kept while the tensors live there

    new = perturbed(before)
    for bucket, flat in zip(buckets, flats, strict=True):  # what a broadcast would write
        for tensor in bucket.tensors:
            nbytes = new[tensor.name].numel() * 4
            flat[tensor.offset : tensor.offset + nbytes].copy_(
                new[tensor.name].reshape(-1).view(torch.uint8)
            )
    assert backend.version == 0
    backend.weights_written(7)
    assert backend.version == 7
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor, new[name]), name  # the tied head too: one tensor
    rollouts = make_rollouts()
    backend.generate_chunk(rollouts, CHUNK)  # the model runs on its new home
    assert all(r.token_versions and set(r.token_versions) == {7} for r in rollouts)


def test_weight_buffers_refuse_a_layout_the_model_cannot_hold_as_its_own():
    backend = make_backend()
    state = backend.model.state_dict()
    both_tied_names = offer_buckets(state, set())  # one tensor under two names
    assert backend.weight_buffers(both_tied_names) is None
    as_bf16 = [
        bucket.__class__("bfloat16", bucket.nbytes, bucket.tensors)
        for bucket in offer_buckets(state, {"lm_head.weight"})
    ]
    assert backend.weight_buffers(as_bf16) is None
    for name, tensor in backend.model.state_dict().items():  # nothing moved or changed
        assert torch.equal(tensor, state[name]), name
