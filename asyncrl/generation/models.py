"""Build the policy and its tokenizer: a Hugging Face model, a GGUF file, or a tiny one.

``model.name_or_path`` names a Hugging Face folder, a Hub name, or a ``.gguf``
file. A GGUF file is dequantized into an ordinary float model (transformers
reads it with the ``gguf`` package): the result trains, checkpoints and saves
with ``save_pretrained`` like any other, so every role and the final export
treat all three sources alike. Learner and generators call the same function
with the same config and seed, so they start from identical weights before any
are published.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from asyncrl.config import ModelConfig
from asyncrl.generation.char_tokenizer import build_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def gguf_location(name_or_path: str) -> tuple[str, str] | None:
    """``(folder, file name)`` when ``name_or_path`` is a GGUF file, else None."""
    path = Path(name_or_path)
    if path.suffix.lower() != ".gguf":
        return None
    return str(path.parent), path.name


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face folder, Hub name or GGUF file, with a pad token."""
    gguf = gguf_location(name_or_path)
    if gguf is None:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1])
        if gguf_adds_bos(Path(*gguf)):
            tokenizer.add_bos_token = True  # transformers' conversion drops it
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def gguf_adds_bos(path: Path) -> bool:
    """The GGUF file's ``tokenizer.ggml.add_bos_token``: whether its model expects a BOS
    before any text (Gemma's does, and answers nonsense without one). transformers 5
    reads the vocabulary from the file but not this flag, so text would be encoded
    without the BOS the model was trained with."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.add_bos_token")
    return bool(field is not None and field.data and field.parts[field.data[0]][0])


def load_pretrained(name_or_path: str, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM at ``name_or_path``; a GGUF file comes back dequantized.

    transformers refuses to ``save_pretrained`` a model it loaded from GGUF, so
    its weights are moved into a fresh model of the same architecture whose
    config no longer mentions the quantized file.
    """
    gguf = gguf_location(name_or_path)
    if gguf is None:
        return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    folder, name = gguf
    if not (Path(folder) / name).is_file():
        raise FileNotFoundError(f"model.name_or_path: no GGUF file at {name_or_path}")
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model_config = quantized.config
    if hasattr(model_config, "quantization_config"):
        del model_config.quantization_config
    model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    model.load_state_dict(quantized.state_dict())
    return model


def build_policy(config: ModelConfig, seed: int) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The causal LM and tokenizer named by ``config``, in eval mode on the CPU."""
    if config.name_or_path is not None:
        tokenizer = load_tokenizer(config.name_or_path)
        model = load_pretrained(config.name_or_path, DTYPES[config.dtype])
    else:
        tokenizer = build_tokenizer()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(
                tiny_model_config(config, tokenizer), dtype=DTYPES[config.dtype]
            )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def tiny_model_config(config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    tiny = config.tiny
    assert tiny is not None
    return Qwen2Config(
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


def empty_like(model_config: PretrainedConfig, dtype: torch.dtype) -> torch.nn.Module:
    """A model of ``model_config``'s architecture to load a state dict into (no file read)."""
    return AutoModelForCausalLM.from_config(model_config, dtype=dtype)


def export_pretrained(name_or_path: str, output: Path, dtype: str = "float32") -> Path:
    """Write the model at ``name_or_path`` (folder, Hub name or GGUF) as a Hugging Face
    folder that ``from_pretrained`` and vLLM load directly: no dequantizing at every start."""
    model = load_pretrained(name_or_path, DTYPES[dtype])
    tokenizer = load_tokenizer(name_or_path)
    output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def tied_names(model: torch.nn.Module) -> tuple[str, str] | None:
    """``(embedding, lm_head)`` state-dict names of a model that ties them, else None."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return None
    embedding = model.get_input_embeddings().weight
    names = [n for n, t in model.state_dict(keep_vars=True).items() if t is embedding]
    (input_name,) = [n for n, p in model.named_parameters() if p is embedding]
    heads = [n for n in names if n != input_name]
    return (input_name, heads[0]) if heads else None
