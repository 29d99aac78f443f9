"""A tokenizer whose pad token is its EOS (SmolLM2, Qwen: ``<|im_end|>``): the EOS that ends
a response is still a trained token, and only the padding after it is masked.

Nothing may tell padding from EOS by the token id: the generator keeps the first EOS it
samples (with its log-prob) and drops what ``generate`` pads after it, and the learner's
batch masks by position (attention mask, loss mask), never by ``input_ids != pad_id``.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.config import GeneratorsConfig, ModelConfig, TinyModelConfig
from asyncrl.core.messages import Trajectories, TrajectoryMeta, decode, encode
from asyncrl.generation.models import build_policy
from asyncrl.generators.hf_backend import HFBackend, Rollout
from asyncrl.learner.algorithms import token_logprobs
from asyncrl.learner.batch import collate

torch.set_num_threads(1)

EOS = 2
"""The pad id too, in every test here."""


def meta(group_id: int, prompt_len: int, response_len: int, finish_reason: str):
    return TrajectoryMeta(
        group_id=group_id,
        sample_index=0,
        prompt_len=prompt_len,
        response_len=response_len,
        reward=1.0,
        finish_reason=finish_reason,
        generator_id="gen-0",
    )


def wire_batch():
    """A: prompt [11, 12, 13], response [21, EOS] (ended by EOS, the shorter sample).
    B: prompt [31, 32], response [41, 42, 43, 44, 45] (ended by length).
    Through encode/decode, as the learner receives it."""
    metas = [meta(0, 3, 2, "stop"), meta(1, 2, 5, "length")]
    arrays = {
        "prompt_ids": np.array([11, 12, 13, 31, 32], dtype=np.int32),
        "response_ids": np.array([21, EOS, 41, 42, 43, 44, 45], dtype=np.int32),
        "logprobs": np.array([-0.1, -0.7, -1.1, -1.2, -1.3, -1.4, -1.5], dtype=np.float32),
        "token_versions": np.array([3, 3, 3, 3, 3, 3, 3], dtype=np.int32),
        "loss_mask": np.ones(7, dtype=np.uint8),
    }
    body, frames = decode(encode(Trajectories(metas), arrays))
    return body.samples, frames


def test_the_ending_eos_is_a_real_token_and_only_the_padding_after_it_is_masked():
    batch = collate(*wire_batch(), pad_id=EOS)
    # A is 5 tokens, padded with EOS to B's 7: the id alone cannot tell them apart
    assert batch.input_ids[0].tolist() == [11, 12, 13, 21, EOS, EOS, EOS]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0]
    # position t predicts token t + 1: A's EOS (token 4) is predicted at position 3
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0]
    assert batch.behavior_logprobs[0, 3].item() == np.float32(-0.7)
    assert batch.token_versions[0].tolist() == [-1, -1, 3, 3, -1, -1]
    assert batch.response_lengths.tolist() == [2, 5]
    assert batch.loss_mask[1].tolist() == [0, 1, 1, 1, 1, 1]


def test_the_policy_gradient_reaches_the_ending_eos_and_not_the_padding():
    """The learner's per-token log-probs under the loss mask: the EOS logit at A's last
    response position gets a gradient, the positions predicting padding none."""
    batch = collate(*wire_batch(), pad_id=EOS)
    logits = torch.randn(2, batch.input_ids.shape[1], 50, requires_grad=True)
    logprobs = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], 1.0)
    (logprobs * batch.loss_mask).sum().backward()
    grad = logits.grad[0]
    assert grad[3, EOS].item() != 0.0  # A's EOS is trained on
    assert grad[4].abs().sum().item() == 0.0 and grad[5].abs().sum().item() == 0.0


def test_hf_generation_with_pad_equal_to_eos_keeps_each_first_eos_and_drops_the_padding():
    """Rows that end early in a chunk are padded with pad = EOS by ``generate`` while the
    others go on; each response ends at its first EOS, kept with its log-prob."""
    model, tokenizer = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    tokenizer.pad_token = tokenizer.eos_token
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    sampling = GeneratorsConfig(max_new_tokens=12, chunk_tokens=12, temperature=1.0)
    backend = HFBackend(model, tokenizer, sampling)

    def raise_eos(module, inputs, output):  # EOS likely, but not at once
        output = output.clone()
        output[..., eos] += 2.0
        return output

    hook = backend.model.lm_head.register_forward_hook(raise_eos)
    try:
        torch.manual_seed(0)
        prompts = [[1, *[3 + (7 * i + j) % 10 for j in range(3)], 13] for i in range(16)]
        rollouts = [Rollout(0, i, p, "x") for i, p in enumerate(prompts)]
        backend.generate_chunk(rollouts, 12)  # one chunk: the whole response
        ended = [r for r in rollouts if r.finish_reason == "stop"]
        longest = max(len(r.response_ids) for r in rollouts)
        early = [r for r in ended if len(r.response_ids) < longest]
        assert early, "no row ended while another went on: nothing was padded after an EOS"
        for rollout in ended:
            assert rollout.response_ids[-1] == eos and rollout.response_ids.count(eos) == 1
        for rollout in rollouts:
            assert rollout.loss_mask == [1] * len(rollout.response_ids)
            assert len(rollout.logprobs) == len(rollout.token_versions) == len(rollout.loss_mask)
            # the recorded log-prob of every kept token, EOS included, is the learner's
            ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
            with torch.no_grad():
                learner = token_logprobs(backend.model(input_ids=ids).logits[:, :-1], ids[:, 1:])
            recorded = torch.tensor(rollout.logprobs)
            expected = learner[0, len(rollout.prompt_ids) - 1 :]
            assert (recorded - expected).abs().max().item() < 1e-4
    finally:
        hook.remove()
