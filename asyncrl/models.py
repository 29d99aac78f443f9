"""Build the policy and its tokenizer: a Hugging Face model by name, or a tiny one.

Learner and generators call the same function with the same config and seed,
so they start from identical weights before any are published.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase, Qwen2Config

from asyncrl.config import ModelConfig
from asyncrl.tasks import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_policy(config: ModelConfig, seed: int) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The causal LM and tokenizer named by ``config``, in eval mode on the CPU."""
    if config.name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(config.name_or_path)
        model = AutoModelForCausalLM.from_pretrained(
            config.name_or_path, dtype=DTYPES[config.dtype]
        )
    else:
        tokenizer = build_tokenizer()
        tiny = config.tiny
        model_config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=tiny.hidden_size,
            intermediate_size=tiny.intermediate_size,
            num_hidden_layers=tiny.num_layers,
            num_attention_heads=tiny.num_heads,
            num_key_value_heads=tiny.num_heads,
            max_position_embeddings=tiny.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(model_config, dtype=DTYPES[config.dtype])
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer
