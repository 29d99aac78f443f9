"""The built-in character-level tokenizer (digits and a few symbols), built in code.

The embedded default needs no downloads: the tiny model (:mod:`asyncrl.generation.models`) and
the synthetic task (:mod:`asyncrl.generation.tasks`) both use this tokenizer. It lives apart
from both so that neither has to import the other for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers loads slowly: only the callers that build one pay for it
    from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
CHARACTERS = list("0123456789=+-*/ ")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over digits and a few symbols, built in code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
