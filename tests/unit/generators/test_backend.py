"""The backend contract's shared pieces: endings, stop strings, the factory, HF's KV cache."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import (
    Config,
    ConfigError,
    GeneratorsConfig,
    ModelConfig,
    TinyModelConfig,
    load_config,
)
from asyncrl.generation.models import build_policy
from asyncrl.generation.tasks import build_tokenizer
from asyncrl.generators import backend as contract
from asyncrl.generators.backend import Backend, Rollout, StopStrings, append_tokens
from asyncrl.generators.engines import build_backend
from asyncrl.generators.hf_backend import HFBackend

torch.set_num_threads(1)

TOKENIZER = build_tokenizer()
EOS = TOKENIZER.eos_token_id


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def grow(rollout: Rollout, text: str, stop: list[str], max_new: int = 20, version: int = 0):
    tokens = ids(text)
    logprobs = [-float(i + 1) for i in range(len(tokens))]
    append_tokens(
        rollout, tokens, logprobs, version, eos_token_id=EOS, max_new_tokens=max_new,
        stop=StopStrings(TOKENIZER, stop),
    )  # fmt: skip


def test_rollout_is_still_importable_from_the_hf_backend():
    from asyncrl.generators.hf_backend import Rollout as FromHF

    assert FromHF is contract.Rollout


def test_a_stop_string_keeps_the_token_completing_it_and_drops_the_rest():
    rollout = Rollout(0, 0, [1], "x")
    grow(rollout, "12=345", stop=["=3"])
    assert TOKENIZER.decode(rollout.response_ids) == "12=3"
    assert rollout.finish_reason == "stop"
    assert rollout.logprobs == [-1.0, -2.0, -3.0, -4.0]  # aligned with the tokens kept
    assert rollout.token_versions == [0, 0, 0, 0]


def test_a_stop_string_spanning_two_chunks_is_found_in_the_second():
    rollout = Rollout(0, 0, [1], "x")
    grow(rollout, "45=", stop=["=67"], version=0)
    assert not rollout.finished
    grow(rollout, "6789", stop=["=67"], version=1)
    assert TOKENIZER.decode(rollout.response_ids) == "45=67"
    assert rollout.finish_reason == "stop"
    assert rollout.token_versions == [0, 0, 0, 1, 1]


def test_eos_ends_with_stop_and_max_new_tokens_with_length():
    rollout = Rollout(0, 0, [1], "x")
    append_tokens(rollout, [5, EOS, 6], [-1.0, -2.0, -3.0], 3, eos_token_id=EOS,
                  max_new_tokens=9, stop=StopStrings(TOKENIZER, []))  # fmt: skip
    assert (rollout.response_ids, rollout.finish_reason) == ([5, EOS], "stop")
    rollout = Rollout(0, 0, [1], "x")
    grow(rollout, "123456", stop=[], max_new=4)
    assert (len(rollout.response_ids), rollout.finish_reason) == (4, "length")


def test_a_stop_string_on_the_last_allowed_token_is_a_stop():
    rollout = Rollout(0, 0, [1], "x")
    grow(rollout, "1234", stop=["4"], max_new=4)
    assert rollout.finish_reason == "stop"


def test_stop_strings_that_were_already_there_are_not_matched_again():
    stop = StopStrings(TOKENIZER, ["7"])
    assert stop.completed_by_last_token(ids("17"))
    assert not stop.completed_by_last_token(ids("178"))
    assert not StopStrings(TOKENIZER, []).completed_by_last_token(ids("7"))


def test_a_stop_string_that_is_a_special_token_ends_the_response():
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    eot = tokenizer.convert_tokens_to_ids("<|eot|>")
    assert eot != tokenizer.eos_token_id  # a turn marker that is not EOS (Gemma, Llama-3)
    stop = StopStrings(tokenizer, ["<|eot|>"])
    digits = tokenizer.encode("12", add_special_tokens=False)
    assert stop.completed_by_last_token([*digits, eot])
    assert not stop.completed_by_last_token([*digits, eot, *digits])


def test_the_factory_builds_the_hf_backend_by_default(tmp_path):
    config = Config(model=ModelConfig(tiny=TinyModelConfig()))
    model, tokenizer = build_policy(config.model, seed=0)
    backend = build_backend(config, model, tokenizer, tmp_path)
    assert isinstance(backend, HFBackend) and isinstance(backend, Backend)
    assert backend.version == 0
    backend.close()


def test_the_config_names_the_two_engines_and_nothing_else():
    assert GeneratorsConfig(backend="vllm").backend == "vllm"
    with pytest.raises(ConfigError, match=r"generators\.backend"):
        load_config(None, ["model.tiny.hidden_size=64", "generators.backend=sglang"])


@torch.no_grad()
def test_hf_generates_a_chunk_with_its_kv_cache_one_forward_per_token():
    model, tokenizer = build_policy(ModelConfig(tiny=TinyModelConfig()), seed=0)
    backend = HFBackend(model, tokenizer, GeneratorsConfig(max_new_tokens=8))
    widths = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape), with_kwargs=True
    )

    def no_eos(module, inputs, output):
        output = output.clone()
        output[..., tokenizer.eos_token_id] -= 30.0
        return output

    bias = model.lm_head.register_forward_hook(no_eos)
    try:
        rollouts = [Rollout(0, i, [1, 3 + i, 4, 13], "x") for i in range(3)]
        backend.generate_chunk(rollouts, 5)
    finally:
        hook.remove()
        bias.remove()
    # the prefill sees the batch's whole prefix, every later step one new token per row
    assert widths == [torch.Size([3, 4])] + [torch.Size([3, 1])] * 4
