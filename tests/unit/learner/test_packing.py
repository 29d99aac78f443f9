"""Packed sequences with shared prompts compute what padded rows compute, on fewer positions.

``learner/packing.py`` runs the samples of a group as one sequence over their shared
prompt; these tests hold it to the padded layout: the same log-probs, entropies, values,
metrics and weights after real learner steps (up to float rounding), and a model that
would compute something else that way is not packed.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.learner import packing
from asyncrl.learner.algorithms import logprobs as head_chunks
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.microbatch import MicroBatch
from asyncrl.learner.packing import Layout, packed_input, padded_input, token_outputs
from asyncrl.learner.policy import Learner
from tests.helpers.learner import GROUP, TINY_LEARNER, synthetic_batch

PROMPT = 3
"""The synthetic batch's prompt length: its loss mask starts at position 2."""


def shared_prompt_batch(step: int) -> TrainBatch:
    """The synthetic batch with each group's prompt made the same, as in a GRPO batch."""
    batch = synthetic_batch(step, len(build_tokenizer()))
    for row in range(batch.num_samples):
        batch.input_ids[row, :PROMPT] = batch.input_ids[row - row % GROUP, :PROMPT]
    return batch


def whole(batch: TrainBatch) -> MicroBatch:
    return MicroBatch(torch.arange(batch.num_samples), batch.input_ids.shape[1])


LR = float(next(o for o in TINY_LEARNER if o.startswith("learner.lr=")).split("=")[1])


def make_learner(ranks: Ranks, *overrides: str) -> Learner:
    config = load_config(None, [*TINY_LEARNER, *overrides])
    torch.manual_seed(config.run.seed)
    return Learner(config, ranks)


def test_a_group_s_prompt_runs_once_and_no_position_is_padding():
    batch = shared_prompt_batch(0)
    lengths = batch.attention_mask.sum(1)
    inputs = packed_input(whole(batch), batch, torch.device("cpu"))
    groups = batch.num_samples // GROUP
    assert inputs.input_ids.shape[0] == groups  # one packed sequence per group
    real = [
        PROMPT + int((lengths[g * GROUP : (g + 1) * GROUP] - PROMPT).sum()) for g in range(groups)
    ]
    assert inputs.positions == groups * max(real)  # padding only up to the longest group
    assert inputs.positions < padded_input(whole(batch), batch, torch.device("cpu")).positions
    trained = batch.loss_mask.bool()
    assert inputs.targets.tolist() == batch.input_ids[:, 1:][trained].tolist()


def test_a_response_sees_its_prompt_and_itself_and_not_the_other_responses():
    batch = shared_prompt_batch(0)
    inputs = packed_input(whole(batch), batch, torch.device("cpu"))
    mask = inputs.attention_mask[0, 0]  # [L, L] of the first group
    length = int(batch.attention_mask[0].sum())
    first_tail = range(PROMPT, length)  # row 0's own tokens, right after the prompt
    second = length  # the first token of row 1's response
    assert all(mask[q, :PROMPT].all() for q in first_tail)  # the prompt
    assert not mask[second, PROMPT:length].any()  # row 1 never sees row 0's response
    assert mask[second, :PROMPT].all() and mask[second, second]
    assert inputs.position_ids[0, second] == PROMPT  # where it is in its own row


@pytest.mark.parametrize("value_head", [False, True])
def test_packed_log_probs_entropies_values_and_gradients_equal_the_padded_ones(
    ranks: Ranks, value_head: bool
):
    overrides = ["algorithm.advantage=gae", "algorithm.kl_coef=0"] if value_head else []
    learner = make_learner(ranks, "learner.pack_sequences=false", *overrides)
    batch = shared_prompt_batch(0)
    got = {}
    for name, layout in (("padded", padded_input), ("packed", packed_input)):
        learner.model.zero_grad(set_to_none=True)
        inputs = layout(whole(batch), batch, torch.device("cpu"))
        out = token_outputs(learner.model, inputs, temperature=0.7, entropy="loss")
        objective = (out.logprobs * batch.loss_mask).sum() + out.entropy.sum()
        if value_head:
            objective = objective + out.values.sum()
        objective.backward()
        grads = torch.cat([p.grad.full_tensor().reshape(-1) for p in learner.model.parameters()])
        got[name] = (out, grads)
    (padded, padded_grads), (packed, packed_grads) = got["padded"], got["packed"]
    trained = batch.loss_mask.bool()
    torch.testing.assert_close(
        packed.logprobs[trained], padded.logprobs[trained], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(packed.entropy[trained], padded.entropy[trained], atol=1e-5, rtol=0)
    if value_head:
        torch.testing.assert_close(
            packed.values[trained], padded.values[trained], atol=1e-5, rtol=0
        )
    torch.testing.assert_close(packed_grads, padded_grads, atol=1e-5, rtol=1e-4)
    assert (packed.logprobs[~trained] == 0).all()  # nothing computed where nothing trains


@pytest.mark.parametrize("entropy", ["loss", "metric"])
def test_the_head_in_chunks_through_fsdp_gives_the_whole_head_s_outputs_and_gradients(
    ranks: Ranks, monkeypatch, entropy: str
):
    learner = make_learner(ranks, "learner.pack_sequences=false")
    batch = shared_prompt_batch(0)
    inputs = packed_input(whole(batch), batch, torch.device("cpu"))
    vocab = len(build_tokenizer())
    got = {}
    for name, chunk in (("whole", None), ("chunked", 3 * vocab)):  # 3 tokens a chunk
        if chunk is not None:
            monkeypatch.setattr(head_chunks, "HEAD_CHUNK_ELEMENTS", chunk)
        calls = []
        monkeypatch.setattr(packing, "head_token_outputs", counted(calls))
        learner.model.zero_grad(set_to_none=True)
        out = token_outputs(learner.model, inputs, temperature=0.7, entropy=entropy)
        assert bool(calls) == (chunk is not None)  # small logits stay whole
        (out.logprobs * batch.loss_mask).sum().backward()
        grads = torch.cat([p.grad.full_tensor().reshape(-1) for p in learner.model.parameters()])
        got[name] = (out, grads)
    (whole_out, whole_grads), (chunked_out, chunked_grads) = got["whole"], got["chunked"]
    torch.testing.assert_close(chunked_out.logprobs, whole_out.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked_out.entropy, whole_out.entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked_grads, whole_grads, atol=1e-5, rtol=1e-4)


def test_the_head_in_chunks_on_a_tied_gemma3_with_262k_tokens_gives_the_whole_head_s_outputs(
    monkeypatch,
):
    """The same as above on Gemma-3's kind of head: tied to the embedding (whose gradient
    then comes from the chunks and from the input side at once) over Gemma's 262,144-token
    vocabulary, in a tiny random model (tests/integration/test_gemma_standin.py runs
    such a model end to end). Rows longer than the sliding window: the padded layout."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    vocab = 262_144
    config = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4,
        max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    batch = shared_prompt_batch(0)
    inputs = padded_input(whole(batch), batch, torch.device("cpu"))
    assert inputs.targets.numel() * vocab <= head_chunks.HEAD_CHUNK_ELEMENTS  # whole unpatched
    got = {}
    for name, chunk in (("whole", None), ("chunked", 8 * vocab)):  # 8 tokens a chunk
        if chunk is not None:
            monkeypatch.setattr(head_chunks, "HEAD_CHUNK_ELEMENTS", chunk)
        calls = []
        monkeypatch.setattr(packing, "head_token_outputs", counted(calls))
        model.zero_grad(set_to_none=True)
        out = token_outputs(model, inputs, temperature=0.7, entropy="loss")
        assert bool(calls) == (chunk is not None)
        ((out.logprobs * batch.loss_mask).sum() + out.entropy.sum()).backward()
        got[name] = (out, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    (whole_out, whole_grads), (chunked_out, chunked_grads) = got["whole"], got["chunked"]
    trained = batch.loss_mask.bool()
    assert (whole_out.logprobs[trained] < 0).all()  # log-probs of real tokens, not fillers
    torch.testing.assert_close(chunked_out.logprobs, whole_out.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked_out.entropy, whole_out.entropy, atol=1e-5, rtol=0)
    # the tied embedding's gradient reaches 48 here (Gemma scales the input embedding by
    # sqrt(hidden)), and float32 rounding alone puts the whole head's up to 5e-5 from a
    # float64 run's (the chunks' as far): an absolute 1e-5 of the largest gradient (5e-4),
    # where a chunk gone wrong is off by the size of its gradients
    scale = whole_grads.abs().max().item()
    assert scale > 1
    torch.testing.assert_close(chunked_grads, whole_grads, atol=1e-5 * scale, rtol=1e-4)


def counted(calls: list):
    original = head_chunks.head_token_outputs

    def head_token_outputs(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return head_token_outputs


@pytest.mark.parametrize(
    "overrides",
    [[], ["algorithm.kl_coef=0.1", "algorithm.entropy_coef=0.01"], ["algorithm.advantage=gae"]],
    ids=["grpo", "kl_and_entropy", "gae_with_values"],
)
def test_learner_steps_packed_equal_the_padded_steps(ranks: Ranks, overrides: list[str]):
    runs = {}
    for setting in ("false", "true"):
        learner = make_learner(ranks, f"learner.pack_sequences={setting}", *overrides)
        assert learner.update.layout.packed == (setting == "true")
        metrics = [learner.train_step(shared_prompt_batch(step)) for step in range(2)]
        runs[setting] = (metrics, dict(learner.full_tensors()))
    (padded_metrics, padded_weights), (packed_metrics, packed_weights) = runs["false"], runs["true"]
    for padded, packed in zip(padded_metrics, packed_metrics, strict=True):
        assert padded.keys() == packed.keys()
        assert packed.pop("learner_positions") < padded.pop("learner_positions")
        for key in padded:
            assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-5), key
    # AdamW divides by the gradient's own size, so a rounding difference in a near-zero
    # gradient moves that weight by up to lr (0.01 here): a few weights may differ by a
    # fraction of lr, but a packing error would move many of them. Counted over the
    # model: a key projection's bias has a zero gradient in exact arithmetic (softmax
    # ignores a shift shared by every key), so its 32 weights move by rounding alone.
    differences = []
    for name, tensor in padded_weights.items():
        difference = (packed_weights[name] - tensor).abs()
        assert difference.max() <= 0.1 * LR, name
        differences.append(difference.reshape(-1))
    assert (torch.cat(differences) > 1e-5).float().mean() <= 0.01


def test_a_model_that_reads_packed_input_differently_is_not_packed(ranks: Ranks, monkeypatch):
    # attention that ignores who may see whom: every token sees every earlier token
    original = packing.packed_input

    def leaky(*args, **kwargs):
        inputs = original(*args, **kwargs)
        length = inputs.input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        return packing.ModelInput(
            **{**inputs.__dict__, "attention_mask": causal.expand_as(inputs.attention_mask)}
        )

    monkeypatch.setattr(packing, "packed_input", leaky)
    learner = make_learner(ranks)  # auto
    assert not learner.update.layout.packed
    assert "differ from padded" in learner.update.layout.reason
    with pytest.raises(ValueError, match="pack_sequences=true, but the model"):
        make_learner(ranks, "learner.pack_sequences=true")


def test_attention_without_4d_masks_is_not_packed(ranks: Ranks):
    learner = make_learner(ranks)
    model = learner.update.model
    config = model.config
    config._attn_implementation = "flash_attention_2"
    try:
        layout = Layout(model, "auto", ranks.device, ranks.world_size)
    finally:
        config._attn_implementation = "sdpa"
    assert not layout.packed and "takes no 4-D mask" in layout.reason


def test_a_sliding_window_model_packs_only_micro_batches_within_its_window(ranks: Ranks):
    learner = make_learner(ranks)
    layout = learner.update.layout
    assert layout.packed and layout.window is None
    batch = shared_prompt_batch(0)
    width = batch.input_ids.shape[1]
    layout.window = width - 1  # rows longer than the window need the window's own mask
    assert layout.input(whole(batch), batch, torch.device("cpu")).position_ids is None
    layout.window = width
    inputs = layout.input(whole(batch), batch, torch.device("cpu"))
    assert inputs.position_ids is not None and inputs.input_ids.shape[1] <= width


def test_a_filler_micro_batch_with_nothing_to_train_still_runs(ranks: Ranks):
    learner = make_learner(ranks)
    batch = shared_prompt_batch(0)
    batch.loss_mask.zero_()
    part = MicroBatch(torch.tensor([0]), batch.input_ids.shape[1], weight=0.0)
    inputs = learner.update.layout.input(part, batch, torch.device("cpu"))
    out = token_outputs(learner.model, inputs, 1.0)
    out.logprobs.sum().backward()  # every parameter gets a gradient (FSDP's collectives)
    assert all(p.grad is not None for p in learner.model.parameters())
