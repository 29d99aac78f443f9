"""Issue 27, F2 and F3 in prompt files: parquet rows, row groups and files have size caps
checked before what they bound is read whole (only the layout's columns, a batch at a
time), consistent with JSONL's; numbers and cells Python cannot read are one line naming
FILE:ROW."""

from __future__ import annotations

import decimal
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from asyncrl.config import load_config
from asyncrl.generation import data_files
from asyncrl.generation.data import DataError, Row, scan_rows
from asyncrl.run.preflight import PreflightError, preflight


def row(question: str = "What is 8 * 9?", **fields) -> dict:
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"ground_truth": "72"},
        "extra_info": {"index": 0},
        **fields,
    }


def write_parquet(path: Path, rows: list[dict], **options) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, **options)
    return path


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def scanned(path: Path) -> list[Row | DataError]:
    return list(scan_rows(path))


# --------------------------------------------------------------------------
# F2: size caps, checked before what they bound is read


def test_a_row_group_over_its_cap_is_refused_from_the_metadata_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "MAX_ROW_GROUP_BYTES", 1 << 20)
    path = write_parquet(tmp_path / "big.parquet", [row(), row("x" * (2 << 20)), row()])
    read = []
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: read.append(1) or iter(()))

    with pytest.raises(DataError) as error:
        scanned(path)

    assert str(error.value).startswith(
        f"{path}: row group 0 (rows 1 to 3) holds 2.0 MiB uncompressed, 2.0 MiB of it in "
        "column 'prompt'; a row group may hold at most 1 MiB"
    )
    assert "row_group_size=" in str(error.value)
    assert not read, "the row group was read before its size was checked"


def test_a_row_over_its_cap_names_its_row_and_the_other_rows_are_read(tmp_path):
    huge = "x" * (data_files.MAX_ROW_BYTES + 1000)
    path = write_parquet(tmp_path / "rows.parquet", [row(), row(), row(huge), row(), row()])

    rows = scanned(path)

    assert [type(item).__name__ for item in rows] == ["Row", "Row", "DataError", "Row", "Row"]
    assert str(rows[2]) == f"{path}:3: a row of 1.0 MiB; a prompt row is at most 1 MiB"
    assert rows[3].source == f"{path}:4"


def test_only_the_layouts_columns_are_read_and_capped(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "MAX_ROW_GROUP_BYTES", 1 << 20)
    rows = [row(images=b"\0" * (1 << 20)) for _ in range(3)]  # 3 MiB of a column not read
    path = write_parquet(tmp_path / "wide.parquet", rows, compression="none")

    assert [item.source for item in scanned(path)] == [f"{path}:{n}" for n in (1, 2, 3)]


def test_small_row_groups_are_read_one_after_another(tmp_path, monkeypatch):
    monkeypatch.setattr(data_files, "MAX_ROW_GROUP_BYTES", 64 << 10)
    rows = [row(f"question {n} " + "x" * 10_000) for n in range(40)]  # 400 KB in all
    path = write_parquet(tmp_path / "groups.parquet", rows, row_group_size=4)

    scanned_rows = scanned(path)

    assert [r.messages[0]["content"][:12] for r in scanned_rows[:2]] == [
        "question 0 x",
        "question 1 x",
    ]
    assert len(scanned_rows) == 40 and scanned_rows[-1].source == f"{path}:40"


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_file_over_its_cap_is_refused_before_a_row_is_read(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(data_files, "MAX_FILE_BYTES", 4 << 10)
    rows = [row("x" * 3000), row("y" * 3000)]
    path = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, [json.dumps(r) for r in rows])
    else:
        write_parquet(path, rows)

    with pytest.raises(DataError) as error:
        scanned(path)

    assert str(error.value).startswith(f"{path}: ")
    assert "a prompt file is at most 4 KiB (split it into several files)" in str(error.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_file_of_more_rows_than_its_cap_is_refused(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(data_files, "MAX_ROWS", 3)
    path = tmp_path / f"train{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, [json.dumps(row())] * 4)
    else:
        write_parquet(path, [row()] * 4)

    with pytest.raises(DataError, match=r"more than 3 rows; a prompt file has at most that many"):
        scanned(path)


SCAN_AND_REPORT_PEAK = """
import sys
from asyncrl.generation.data import DataError, scan_rows
try:
    list(scan_rows(sys.argv[1]))
except DataError as error:
    print(error)
status = open("/proc/self/status").read()  # VmHWM: this program's peak, not its parent's
print(int(status.split("VmHWM:")[1].split()[0]) // 1024)
"""


@pytest.mark.slow
def test_the_issues_file_a_300_mb_cell_in_15_mb_is_refused_in_little_memory(tmp_path):
    """The issue's file: one 300 MB prompt cell that compresses to 14 MB drove `asyncrl
    validate` to 13.6 GB. Scanning it now stays near the interpreter's own size."""
    path = tmp_path / "big_cell.parquet"
    writer = (
        "import sys, pyarrow as pa, pyarrow.parquet as pq\n"
        "row = lambda text: {'data_source': 'openai/gsm8k', 'prompt': [{'role': 'user', "
        "'content': text}], 'reward_model': {'ground_truth': '1'}}\n"
        "rows = [row('a' * (300 << 20))] + [row(f'q{i}') for i in range(99)]\n"
        "pq.write_table(pa.Table.from_pylist(rows), sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", writer, str(path)], check=True)
    assert path.stat().st_size < 20 << 20

    scan = subprocess.run(
        [sys.executable, "-c", SCAN_AND_REPORT_PEAK, str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )

    problem, peak_mib = scan.stdout.splitlines()
    assert problem.startswith(f"{path}: row group 0 (rows 1 to 100) holds 300.0 MiB")
    assert int(peak_mib) < 300, f"scanning took {peak_mib} MiB"


# --------------------------------------------------------------------------
# F3: values that cannot be read, or cannot be sent on


@pytest.mark.parametrize("field", ["extra_info", "reward_model"])
def test_a_number_past_4300_digits_in_jsonl_names_its_line(tmp_path, field):
    value = {"n": int("7" * 4300)} if field == "extra_info" else {"ground_truth": 0}
    line = json.dumps(row(**{field: value}))
    if field == "reward_model":
        line = line.replace('"ground_truth": 0', '"ground_truth": ' + "9" * 5000)
    else:
        line = line.replace("7" * 4300, "7" * 5000)
    path = write_jsonl(tmp_path / "train.jsonl", [json.dumps(row()), line])

    rows = scanned(path)

    assert isinstance(rows[0], Row)
    assert str(rows[1]) == (
        f"{path}:2: a number of more than 4300 digits, which Python does not read; "
        "a prompt row needs none"
    )


def test_extra_info_that_cannot_be_sent_to_the_reward_function_names_its_row(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [json.dumps(row(extra_info={"id": 2**70}))])

    (problem,) = scanned(path)

    assert str(problem) == (
        f"{path}:1: 'extra_info' holds a value that cannot be sent to the reward function: "
        "can't serialize ints < -2**63 or > 2**64 - 1"
    )


def test_a_parquet_ground_truth_that_cannot_be_written_as_text_names_its_row(tmp_path):
    truth = pa.array([decimal.Decimal("1.50")], type=pa.decimal128(5, 2))
    table = pa.Table.from_pylist([row()]).drop_columns(["reward_model"])
    table = table.append_column(
        "reward_model", pa.StructArray.from_arrays([truth], names=["ground_truth"])
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)

    (problem,) = scanned(path)

    assert str(problem) == (
        f"{path}:1: 'reward_model.ground_truth' cannot be written as text: "
        "TypeError: Object of type Decimal is not JSON serializable"
    )


def test_a_parquet_cell_python_cannot_hold_names_its_row_and_the_rest_are_read(tmp_path):
    table = pa.Table.from_pylist([row(), row(), row()]).drop_columns(["extra_info"])
    seconds = pa.array([0, 253402300800 * 1000, 0], type=pa.timestamp("s"))  # year 80000
    table = table.append_column("extra_info", pa.StructArray.from_arrays([seconds], ["when"]))
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)

    rows = scanned(path)

    assert isinstance(rows[0], Row) and isinstance(rows[2], Row)
    assert str(rows[1]).startswith(f"{path}:2: cannot read this row: OverflowError: ")


def test_preflight_names_the_file_and_line_of_a_number_python_cannot_read(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl", [json.dumps(row()).replace("0}", "9" * 5000 + "}")]
    )
    config = load_config(None, ["model.tiny={}", f"data.train_files=[{path}]"])

    with pytest.raises(PreflightError) as error:
        preflight(config, machine=False)

    assert (
        f"data.train_files: {path}:1: a number of more than 4300 digits, which Python does "
        "not read; a prompt row needs none"
    ) in error.value.problems


def test_a_problem_stays_one_line_whatever_the_file_name_holds(tmp_path):
    name = tmp_path / "a\nb\u202e.jsonl"
    config = load_config(None, ["model.tiny={}", f"data.train_files=[{json.dumps(str(name))}]"])

    with pytest.raises(PreflightError) as error:
        preflight(config, machine=False)

    assert f"data.train_files: {tmp_path}/a\\nb\\u202e.jsonl: no such data file" in (
        error.value.problems
    )
    assert all("\n" not in problem for problem in error.value.problems)
