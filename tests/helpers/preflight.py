"""Data files, configs and a saved tokenizer for the preflight tests (asyncrl.run.preflight)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.run.preflight import PreflightError, preflight
from tests.helpers.data import chat_tokenizer

TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def character_tokenizer_dir(tmp_path_factory) -> Path:
    """A saved character tokenizer whose chat template refuses a system turn."""
    tokenizer = chat_tokenizer(TEMPLATE)
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return path


def row(question: str, answer: str = "72", source: str = "openai/gsm8k", system: bool = False):
    prompt = [{"role": "user", "content": question}]
    if system:
        prompt.insert(0, {"role": "system", "content": "Be brief."})
    return {"data_source": source, "prompt": prompt, "reward_model": {"ground_truth": answer}}


def jsonl(path: Path, *lines: bytes | dict) -> Path:
    path.write_bytes(b"".join(_line(line) + b"\n" for line in lines))
    return path


def _line(line: bytes | dict) -> bytes:
    return line if isinstance(line, bytes) else json.dumps(line).encode()


def config_for(tokenizer_dir: Path, train: list[Path], *overrides: str):
    return load_config(
        None,
        [
            f"model.name_or_path={tokenizer_dir}",
            f"data.train_files=[{','.join(map(str, train))}]",
            *overrides,
        ],
    )


def problems_of(config, **options) -> list[str]:
    with pytest.raises(PreflightError) as error:
        preflight(config, **options)
    assert str(error.value) == "\n".join(error.value.problems)
    return error.value.problems
