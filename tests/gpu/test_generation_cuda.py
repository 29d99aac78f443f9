"""Hugging Face generation and the learner's log-probs of the tiny model on CUDA agree with
the CPU's: the same greedy tokens, log-probs within float32 rounding; and ``HFBackend`` of a
pool that asks for a GPU (``generators.num_gpus``) samples on it, recording the log-probs
the learner computes for the same tokens, and loads weights sent from the CPU.
"""

from __future__ import annotations

import copy

import torch

from asyncrl.config import GeneratorsConfig
from asyncrl.generation.models import build_policy
from asyncrl.generators.hf_backend import HFBackend, Rollout
from asyncrl.learner.algorithms import token_logprobs
from tests.helpers.gpu import device_batch, tiny_config

NEW_TOKENS = 16


def greedy(model: torch.nn.Module, prompts: torch.Tensor, pad_id: int) -> torch.Tensor:
    """``generate`` without sampling, on the model's device; the tokens come back on the CPU."""
    device = next(model.parameters()).device
    prompts = prompts.to(device)
    out = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,  # no early end at EOS: every position is compared
        pad_token_id=pad_id,
    )
    return out.cpu()


def logprobs(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor):
    device = next(model.parameters()).device
    input_ids, mask = input_ids.to(device), mask.to(device)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    return token_logprobs(logits[:, :-1], input_ids[:, 1:]).cpu()


def test_greedy_tokens_and_token_logprobs_on_cuda_equal_the_cpus():
    config = tiny_config("cuda", "none")
    cpu, tokenizer = build_policy(config.model, config.run.seed)
    cuda = copy.deepcopy(cpu).to("cuda")
    batch = device_batch(0, "cpu")
    prompts = batch.input_ids[:8, :3]

    on_cuda = greedy(cuda, prompts, tokenizer.pad_token_id)
    assert on_cuda.shape == (8, 3 + NEW_TOKENS)
    # the top two logits are at least 0.1 apart at every step here: far above float32 rounding
    assert torch.equal(on_cuda, greedy(cpu, prompts, tokenizer.pad_token_id))

    want = logprobs(cpu, batch.input_ids, batch.attention_mask)
    got = logprobs(cuda, batch.input_ids, batch.attention_mask)
    real = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


def test_hf_backend_of_a_gpu_pool_samples_on_cuda_and_records_the_learners_logprobs():
    config = tiny_config("cuda", "none")
    cpu, tokenizer = build_policy(config.model, config.run.seed)
    sampling = GeneratorsConfig(max_new_tokens=NEW_TOKENS, chunk_tokens=5, num_gpus=0.5)
    backend = HFBackend(copy.deepcopy(cpu), tokenizer, sampling)
    assert {p.device.type for p in backend.model.parameters()} == {"cuda"}
    assert backend.weight_buffers([]) is None  # the broadcast is staged on the host, then loaded

    prompts = device_batch(0, "cpu").input_ids[:8, :3].tolist()
    rollouts = [Rollout(0, i, prompt, "") for i, prompt in enumerate(prompts)]
    torch.manual_seed(0)
    while not all(r.finished for r in rollouts):  # chunks of 5 up to 16 tokens, EOS or not
        backend.generate_chunk(rollouts, sampling.chunk_tokens)
    assert all(r.response_ids for r in rollouts)
    for rollout in rollouts:  # the learner's view of the same tokens, on the CPU
        ids = torch.tensor([rollout.prompt_ids + rollout.response_ids])
        want = logprobs(cpu, ids, torch.ones_like(ids))[0, len(rollout.prompt_ids) - 1 :]
        torch.testing.assert_close(torch.tensor(rollout.logprobs), want, rtol=1e-4, atol=1e-4)

    trained = {name: tensor + 0.01 for name, tensor in cpu.state_dict().items()}
    backend.load_weights(trained, version=1)  # CPU tensors, as every weight path hands them
    assert {p.device.type for p in backend.model.parameters()} == {"cuda"}
    for name, tensor in backend.model.state_dict().items():
        assert torch.equal(tensor.cpu(), trained[name]), name
