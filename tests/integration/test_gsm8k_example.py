"""examples/data/gsm8k.py turns GSM8K files a user has into prompts asyncrl can train on."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.generation.data import PromptDataset
from asyncrl.generation.rewards import REWARD_FUNCTIONS

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "data" / "gsm8k.py"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

TRAIN = [
    {
        "question": "Natalia sold clips to 48 friends in April, and half as many in May. "
        "How many clips did she sell altogether?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\n"
        "Altogether 48+24 = <<48+24=72>>72 clips.\n#### 72",
    },
    {
        "question": "A shop sells 1,000 pens a week for 1.2 dollars each. How much is that?",
        "answer": "1000 * 1.2 = <<1000*1.2=1200>>1200\n#### 1,200",
    },
]
TEST = [{"question": "What is 3 minus 5?", "answer": "3 - 5 = -2\n#### -2"}]


def chat_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", *string.printable])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


def run_script(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_original_jsonl_and_the_hf_parquet_export_convert_to_trainable_prompts(tmp_path):
    source = tmp_path / "gsm8k"
    source.mkdir()
    (source / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in TRAIN))
    (source / "main").mkdir()
    pq.write_table(pa.Table.from_pylist(TEST), source / "main" / "test-00000-of-00001.parquet")

    done = run_script("--input", source, "--output", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert "train: 2 rows" in done.stdout
    assert "test: 1 rows" in done.stdout

    tokenizer = chat_tokenizer()
    train = PromptDataset(tmp_path / "out" / "train.parquet", tokenizer, shuffle=False)
    assert len(train) == 2
    first = train[0]
    assert first.data_source == "openai/gsm8k"
    assert [first.ground_truth, train[1].ground_truth] == ["72", "1200"]
    text = tokenizer.decode(first.prompt_ids)
    assert text == f"<user>{TRAIN[0]['question']} {INSTRUCTION}\n<assistant>"
    assert first.extra_info == {
        "split": "train",
        "index": 0,
        "question": TRAIN[0]["question"],
        "answer": TRAIN[0]["answer"],
    }
    # the reference solutions score 1 with the reward function their data_source picks
    score = REWARD_FUNCTIONS[first.data_source]
    for index, row in enumerate(TRAIN):
        assert score(first.data_source, row["answer"], train[index].ground_truth, None) == 1.0

    test = PromptDataset(tmp_path / "out" / "test.parquet", tokenizer)
    assert (test[0].ground_truth, test[0].extra_info["split"]) == ("-2", "test")


def test_jsonl_output_and_a_bad_row(tmp_path):
    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps(TRAIN[0]) + "\n")
    done = run_script("--input", source, "--output", tmp_path / "out", "--format", "jsonl")
    assert done.returncode == 0, done.stderr
    rows = PromptDataset(tmp_path / "out" / "train.jsonl", chat_tokenizer())
    assert rows[0].ground_truth == "72"

    source.write_text(json.dumps({"question": "?", "answer": "no marker"}) + "\n")
    done = run_script("--input", source, "--output", tmp_path / "out")
    assert done.returncode == 1
    assert "train.jsonl:1: no '#### <number>' in the answer" in done.stderr
