"""Hugging Face generation and the learner's log-probs of the tiny model on CUDA agree with
the CPU's: the same greedy tokens, log-probs within float32 rounding.

``HFBackend`` itself is not put on CUDA: it left-pads its prompts into CPU tensors
(``_left_pad``) and generator replicas build their model on the CPU, so this drives the
same ``generate`` call on the model directly, with its inputs on the model's device.
"""

from __future__ import annotations

import copy

import torch
from gpu_cases import device_batch, tiny_config

from asyncrl.learner.algorithms import token_logprobs
from asyncrl.models import build_policy

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
