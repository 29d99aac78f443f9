"""Prompt files in the verl layout: JSONL and parquet, chat templates, the length filter,
a deterministic order over epochs, and errors that name the file and row."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from asyncrl.config import ConfigError, load_config
from asyncrl.core.messages import WorkGrant, WorkItem, decode, encode
from asyncrl.generation.data import MAX_LINE_BYTES, DataError, PromptDataset, scan_rows
from asyncrl.generation.rewards import RewardFunctionError
from asyncrl.generation.tasks import build_tokenizer, work_item_factory
from tests.helpers.data import TEMPLATE, chat_tokenizer, row, write_jsonl

ROWS = [row("What is 8 * 9?"), row("Add 2 and 3.", "5"), row("And 10 - 4?", "6")]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


def base_tokenizer() -> PreTrainedTokenizerFast:
    """:func:`chat_tokenizer` as a base model's: no chat template, a BOS before any text."""
    tokenizer = chat_tokenizer()
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", bos)]
    )
    tokenizer.chat_template = None
    return tokenizer


def test_plain_text_prompts_are_used_as_they_are_with_the_tokenizer_s_bos(tmp_path):
    base = base_tokenizer()
    text = {**row("unused"), "prompt": "Q: 8 * 9 =\nA:"}
    dataset = PromptDataset(write_jsonl(tmp_path / "a.jsonl", [text, text]), base, shuffle=False)
    first = dataset[0]
    assert first.prompt_ids == [
        base.bos_token_id,
        *base("Q: 8 * 9 =\nA:", add_special_tokens=False)["input_ids"],
    ]
    assert base.decode(first.prompt_ids, skip_special_tokens=True) == "Q: 8 * 9 =\nA:"
    assert first.messages == []  # nothing for a chat template to render
    # a chat prompt in the same file cannot be rendered without a template: named by row
    with pytest.raises(DataError, match=r"b.jsonl:2: a chat-message prompt, and the tokenizer"):
        PromptDataset(write_jsonl(tmp_path / "b.jsonl", [text, row("chat")]), base)


def test_a_plain_text_prompt_and_an_environment_do_not_mix(tmp_path, tokenizer):
    from asyncrl.generation.data import PromptRow
    from asyncrl.generation.tasks import _row_item

    config = load_config(None, ["model.tiny={}", "environment.name=tools"])
    plain = PromptRow(0, [5, 6], "arithmetic", "42", source="a.jsonl:3")
    with pytest.raises(DataError, match=r"a.jsonl:3: a plain-text prompt; an environment needs"):
        _row_item(config, 0, 2, plain)


def test_jsonl_rows_are_rendered_with_the_chat_template(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    dataset = PromptDataset([path], tokenizer, shuffle=False)

    assert len(dataset) == 3
    first = dataset[0]
    assert tokenizer.decode(first.prompt_ids) == "<user>What is 8 * 9?\n<assistant>"
    assert (first.data_source, first.ground_truth) == ("openai/gsm8k", "72")
    assert first.extra_info == {"index": 0}
    assert first.source == f"{path}:1"
    assert dataset[2].ground_truth == "6"
    assert dataset.filtered_too_long == 0
    assert dataset.data_sources == {"openai/gsm8k": 3}


def test_parquet_reads_like_jsonl_and_files_are_concatenated(tmp_path, tokenizer):
    from_jsonl = PromptDataset(write_jsonl(tmp_path / "a.jsonl", ROWS), tokenizer, shuffle=False)
    from_parquet = PromptDataset(
        str(write_parquet(tmp_path / "a.parquet", ROWS)), tokenizer, shuffle=False
    )
    for index in range(3):
        a, b = from_jsonl[index], from_parquet[index]
        assert (a.prompt_ids, a.ground_truth, a.extra_info) == (
            b.prompt_ids,
            b.ground_truth,
            b.extra_info,
        )

    both = PromptDataset([tmp_path / "a.jsonl", tmp_path / "a.parquet"], tokenizer, shuffle=False)
    assert len(both) == 6
    assert both[3].source == f"{tmp_path / 'a.parquet'}:1"


def test_a_multi_turn_prompt_and_a_numeric_ground_truth(tmp_path, tokenizer):
    chat = row("hi", answer=72)
    chat["prompt"] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]
    dataset = PromptDataset(write_jsonl(tmp_path / "chat.jsonl", [chat]), tokenizer)
    assert tokenizer.decode(dataset[0].prompt_ids) == "<system>Be brief.\n<user>hi\n<assistant>"
    assert dataset[0].ground_truth == "72"


def test_prompts_longer_than_the_limit_are_filtered_and_counted(tmp_path, tokenizer, caplog):
    rows = [row("short"), row("x" * 100), row("also short")]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    limit = len("<user>also short\n<assistant>")
    with caplog.at_level(logging.WARNING, logger="asyncrl.data"):
        dataset = PromptDataset(path, tokenizer, max_prompt_tokens=limit, shuffle=False)
    assert len(dataset) == 2
    assert dataset.filtered_too_long == 1
    assert "1 of 3 prompts are longer than max_prompt_tokens" in caplog.text
    assert [dataset[i].source for i in range(2)] == [f"{path}:1", f"{path}:3"]

    with pytest.raises(DataError, match=r"no prompts left.*3 longer than max_prompt_tokens=5"):
        PromptDataset(path, tokenizer, max_prompt_tokens=5)


def test_the_order_is_a_seeded_permutation_per_epoch(tmp_path, tokenizer):
    rows = [row(f"question {i}", str(i)) for i in range(20)]
    path = write_jsonl(tmp_path / "train.jsonl", rows)

    def order(dataset, epoch):
        n = len(dataset)
        return [int(dataset[i].ground_truth) for i in range(epoch * n, (epoch + 1) * n)]

    dataset = PromptDataset(path, tokenizer, seed=3)
    again = PromptDataset(path, tokenizer, seed=3)
    other_seed = PromptDataset(path, tokenizer, seed=4)
    epochs = [order(dataset, epoch) for epoch in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(20))  # every prompt once per epoch
    assert epochs[0] != epochs[1] != epochs[2]
    assert order(again, 2) == epochs[2]  # random access: no state, any index
    assert order(again, 0) == epochs[0]
    assert order(other_seed, 0) != epochs[0]

    plain = PromptDataset(path, tokenizer, shuffle=False)
    assert order(plain, 0) == order(plain, 5) == list(range(20))
    with pytest.raises(IndexError):
        dataset[-1]


@pytest.mark.parametrize(
    "broken, message",
    [
        ({"prompt": None}, "missing field 'prompt'"),
        ({"prompt": {"text": "What is 8 * 9?"}}, "'prompt' must be a string or a non-empty list"),
        ({"prompt": "  "}, "'prompt' is an empty string"),
        ({"prompt": [{"role": "user"}]}, r"prompt\[0\] must have string 'role' and 'content'"),
        ({"data_source": None}, "missing field 'data_source'"),
        ({"reward_model": {"style": "rule"}}, "missing field 'reward_model.ground_truth'"),
        ({"reward_model": None}, "missing field 'reward_model.ground_truth'"),
        ({"extra_info": [1, 2]}, "'extra_info' must be an object"),
    ],
)
def test_a_missing_field_names_the_file_and_row(tmp_path, tokenizer, broken, message):
    bad = {**row("second"), **broken}
    bad = {key: value for key, value in bad.items() if value is not None}
    path = write_jsonl(tmp_path / "train.jsonl", [row("first"), bad])
    with pytest.raises(DataError, match=f"train.jsonl:2: {message}"):
        PromptDataset(path, tokenizer)


def test_file_problems_are_named(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"nothing.jsonl: no such data file"):
        PromptDataset(tmp_path / "nothing.jsonl", tokenizer)
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown data file type '.csv'"):
        PromptDataset(tmp_path / "rows.csv", tokenizer)
    (tmp_path / "bad.jsonl").write_text(json.dumps(row("ok")) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        PromptDataset(tmp_path / "bad.jsonl", tokenizer)
    no_column = [{"prompt": r["prompt"], "data_source": r["data_source"]} for r in ROWS]
    with pytest.raises(DataError, match=r"b.parquet:1: missing field 'reward_model"):
        PromptDataset(write_parquet(tmp_path / "b.parquet", no_column), tokenizer)
    with pytest.raises(
        DataError, match=r"a.jsonl:1: a chat-message prompt, and the tokenizer has no"
    ):
        PromptDataset(write_jsonl(tmp_path / "a.jsonl", ROWS), build_tokenizer())


# --------------------------------------------------------------------------
# from the config to the buffer's work items


def data_config(tmp_path, tokenizer, rows, *overrides):
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    return load_config(
        None,
        [
            f"model.name_or_path={tmp_path / 'tokenizer'}",
            f"data.train_files=[{path}]",
            "algorithm.group_size=4",
            *overrides,
        ],
    )


def test_work_items_come_from_the_data_files(tmp_path, tokenizer):
    config = data_config(tmp_path, tokenizer, ROWS, "data.shuffle=false")
    make_item = work_item_factory(config)

    item = make_item(4)  # epoch 1, row 2
    assert (item.group_id, item.num_samples) == (4, 4)
    assert tokenizer.decode(item.prompt_ids) == "<user>Add 2 and 3.\n<assistant>"
    assert (item.ground_truth, item.data_source, item.extra_info) == (
        "5",
        "openai/gsm8k",
        {"index": 0},
    )
    assert make_item(4) == item  # a requeued group gets the same prompt

    frames = encode(WorkGrant([item], policy_version=0))
    decoded, _ = decode([bytes(memoryview(f)) for f in frames])
    assert decoded.items == [item]
    assert (
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(WorkItem(1, 2, [3], "4")), type=WorkItem
        ).extra_info
        == {}
    )


def test_rows_no_reward_function_can_score_stop_the_buffer_at_start(tmp_path, tokenizer):
    config = data_config(tmp_path, tokenizer, [*ROWS, row("?", source="my/dataset")])
    with pytest.raises(RewardFunctionError, match=r"'my/dataset'"):
        work_item_factory(config)


def test_data_config_keys(tmp_path):
    config = load_config(None, ["model.tiny={}"])
    assert (config.data.train_files, config.data.max_prompt_tokens, config.data.shuffle) == (
        [],
        1024,
        True,
    )
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens"):
        load_config(None, ["model.tiny={}", "data.max_prompt_tokens=0"])


# --------------------------------------------------------------------------
# malformed files: one line naming the file and row, never a bare exception

SMOLLM2 = Path(__file__).resolve().parents[3] / "models" / "SmolLM2-135M-Instruct"
REFUSES_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}" + TEMPLATE
)


def write_lines(path, *lines: bytes):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def json_line(value) -> bytes:
    return json.dumps(value).encode()


def test_a_line_that_is_not_utf8_names_the_file_row_and_byte(tmp_path, tokenizer):
    bad = json_line(row("caf\u00e9")).replace(b"caf\\u00e9", b"caf\xe9")
    path = write_lines(tmp_path / "latin1.jsonl", json_line(row("first")), bad)
    at = bad.index(b"\xe9") + 1
    with pytest.raises(DataError) as error:
        PromptDataset(path, tokenizer)
    assert str(error.value) == (
        f"{path}:2: not UTF-8 text (byte 0xe9 at byte {at} of the line); save the file as UTF-8"
    )


def test_a_chat_template_that_raises_names_the_file_row_and_its_message(tmp_path):
    tokenizer = chat_tokenizer()
    tokenizer.chat_template = REFUSES_SYSTEM
    system = row("hi")
    system["prompt"].insert(0, {"role": "system", "content": "Be brief."})
    path = write_jsonl(tmp_path / "train.jsonl", [row("first"), system])
    with pytest.raises(DataError) as error:
        PromptDataset(path, tokenizer)
    assert str(error.value) == (
        f"{path}:2: the chat template cannot render this prompt: "
        "TemplateError: System role not supported"
    )


@pytest.mark.skipif(not SMOLLM2.is_dir(), reason="needs models/SmolLM2-135M-Instruct")
def test_the_real_tokenizers_template_renders_rows_and_its_errors_name_the_row(tmp_path):
    """SmolLM2's own tokenizer: its template renders a row (with its default system
    turn), and a template of the Mistral kind, which refuses a system turn, fails
    through transformers' own ``raise_exception`` with the row named."""
    from asyncrl.generation.models import load_tokenizer

    tokenizer = load_tokenizer(str(SMOLLM2))
    path = write_jsonl(tmp_path / "train.jsonl", [row("What is 8 * 9?")])
    text = tokenizer.decode(PromptDataset(path, tokenizer)[0].prompt_ids)
    assert text.endswith("<|im_start|>user\nWhat is 8 * 9?<|im_end|>\n<|im_start|>assistant\n")
    tokenizer.chat_template = REFUSES_SYSTEM
    system = row("hi")
    system["prompt"].insert(0, {"role": "system", "content": "Be brief."})
    write_jsonl(path, [row("first"), row("second"), system])
    with pytest.raises(DataError, match=r"train.jsonl:3: the chat template .*System role"):
        PromptDataset(path, tokenizer)


def test_rows_are_numbered_by_line_so_blank_lines_count(tmp_path, tokenizer):
    missing = {key: value for key, value in row("x").items() if key != "data_source"}
    path = write_lines(tmp_path / "gaps.jsonl", json_line(row("a")), b"", b"  ", json_line(missing))
    with pytest.raises(DataError, match=r"gaps.jsonl:4: missing field 'data_source'"):
        PromptDataset(path, tokenizer)
    write_lines(path, json_line(row("a")), b"", json_line(row("b")))
    assert [r.source for r in PromptDataset(path, tokenizer, shuffle=False).rows] == [
        f"{path}:1",
        f"{path}:3",
    ]


def test_an_empty_file_is_named(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "good.jsonl", ROWS)
    for content in (b"", b"\n  \n"):
        (tmp_path / "empty.jsonl").write_bytes(content)
        with pytest.raises(DataError) as error:
            PromptDataset([good, tmp_path / "empty.jsonl"], tokenizer)
        assert (
            str(error.value) == f"{tmp_path / 'empty.jsonl'}: no rows (the file is empty or blank)"
        )


@pytest.mark.parametrize(
    "line, message",
    [
        (b"[1, 2]", "expected an object, got list"),
        (b'"a prompt"', "expected an object, got str"),
        (
            b'{"prompt": [{"role": "user", "content": "x"}]',
            "not valid JSON at column 46: Expecting ',' delimiter",
        ),
        (b"[" * 100_000, "not valid JSON: nested too deeply"),
        (b"\xef\xbb\xbf" + json_line(row("x")), "not valid JSON at column 1: Unexpected UTF-8 BOM"),
    ],
)
def test_a_malformed_line_names_the_file_and_row(tmp_path, tokenizer, line, message):
    path = write_lines(tmp_path / "train.jsonl", json_line(row("first")), line)
    with pytest.raises(DataError) as error:
        PromptDataset(path, tokenizer)
    assert str(error.value).startswith(f"{path}:2: {message}")


def test_a_byte_order_mark_on_the_first_line_is_allowed(tmp_path, tokenizer):
    path = write_lines(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + json_line(row("hi")))
    assert PromptDataset(path, tokenizer)[0].source == f"{path}:1"


def test_a_line_over_the_bound_is_named_and_the_next_row_still_read(tmp_path, tokenizer):
    huge = b'{"prompt": "' + b"x" * (MAX_LINE_BYTES + 10) + b'"}'
    path = write_lines(tmp_path / "big.jsonl", json_line(row("a")), huge, json_line(row("c")))
    with pytest.raises(DataError) as error:
        PromptDataset(path, tokenizer)
    assert str(error.value).startswith(f"{path}:2: line longer than 1 MiB")
    scanned = list(scan_rows(path))
    assert [type(item).__name__ for item in scanned] == ["Row", "DataError", "Row"]
    assert scanned[2].source == f"{path}:3"


def test_scan_rows_reports_each_bad_row_and_goes_on(tmp_path):
    no_truth = {**row("b"), "reward_model": {}}
    path = write_lines(
        tmp_path / "t.jsonl", json_line(row("a")), b"{oops", json_line(no_truth), b"\xff"
    )
    scanned = [
        str(item) if isinstance(item, DataError) else item.source for item in scan_rows(path)
    ]
    assert scanned == [
        f"{path}:1",
        f"{path}:2: not valid JSON at column 2: Expecting property name enclosed in double quotes",
        f"{path}:3: missing field 'reward_model.ground_truth'",
        f"{path}:4: not UTF-8 text (byte 0xff at byte 1 of the line); save the file as UTF-8",
    ]
