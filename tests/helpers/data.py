"""Data files and tokenizers for the data tests."""

from __future__ import annotations

import json
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_tokenizer(template: str = TEMPLATE) -> PreTrainedTokenizerFast:
    """Characters of printable ASCII, one token each, with a small chat template."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", *string.printable])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    tokenizer.chat_template = template
    return tokenizer


def row(question: str, answer: str = "72", source: str = "openai/gsm8k", **extra) -> dict:
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"index": 0, **extra},
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
