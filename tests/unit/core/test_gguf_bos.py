"""A GGUF file's ``tokenizer.ggml.add_bos_token`` survives loading: transformers' conversion
drops it, and Gemma without its BOS answers nonsense."""

from __future__ import annotations

import pytest

from asyncrl.generation.models import gguf_adds_bos

gguf = pytest.importorskip("gguf")


def gguf_file(path, **flags: bool):
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in flags.items():
        writer.add_bool(f"tokenizer.ggml.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "flags, adds", [({"add_bos_token": True}, True), ({"add_bos_token": False}, False), ({}, False)]
)
def test_the_file_s_bos_flag_is_read(tmp_path, flags, adds):
    assert gguf_adds_bos(gguf_file(tmp_path / "m.gguf", **flags)) is adds


def test_a_gguf_tokenizer_whose_file_asks_for_a_bos_puts_one_before_any_text(tmp_path, monkeypatch):
    from asyncrl.generation import models
    from asyncrl.generation.tasks import build_tokenizer

    path = gguf_file(tmp_path / "m.gguf", add_bos_token=True)
    converted = build_tokenizer()  # what transformers' conversion gives: no BOS added
    assert converted("12").input_ids[0] != converted.bos_token_id
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *a, **k: converted)
    tokenizer = models.load_tokenizer(str(path))
    assert tokenizer("12").input_ids[0] == tokenizer.bos_token_id
