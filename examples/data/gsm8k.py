"""Convert GSM8K files you already have into asyncrl's (verl's) prompt layout.

Reads the original release (``train.jsonl``, ``test.jsonl``) or the Hugging Face
parquet export (``main/train-00000-of-00001.parquet``, ...): rows with
``question`` and ``answer``, the answer ending in ``#### <number>``. Writes one
file per split into the output directory::

    python examples/data/gsm8k.py --input ~/data/gsm8k --output data/gsm8k
    python examples/data/gsm8k.py --input test.jsonl --output data/gsm8k --format jsonl

Each output row::

    prompt        [{"role": "user", "content": question + INSTRUCTION}]
    data_source   "openai/gsm8k"          (scored by asyncrl.generation.rewards.gsm8k_score)
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "72"}
    extra_info    {"split", "index", "question", "answer"}

Then train with ``data.train_files=[data/gsm8k/train.parquet]``. Nothing is
downloaded. Parquet needs pyarrow (an asyncrl dependency); JSONL needs nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")


def final_answer(solution: str) -> str:
    """``"... #### 1,200"`` -> ``"1200"``."""
    match = _ANSWER.search(solution)
    if match is None:
        raise ValueError("no '#### <number>' in the answer")
    return match.group(1).replace(",", "").rstrip(".")


def convert_row(row: dict, split: str, index: int) -> dict:
    question, answer = row["question"], row["answer"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": final_answer(answer)},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        lines = path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{path}: expected a .jsonl or .parquet file")


def split_of(path: Path) -> str:
    """``train.jsonl``, ``train-00000-of-00001.parquet`` -> ``train``."""
    return re.split(r"[-_.]", path.name, maxsplit=1)[0]


def input_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"{source}: no such file or directory")
    files = sorted(
        path
        for pattern in ("*.jsonl", "*.parquet")
        for path in source.rglob(pattern)
        if split_of(path) in ("train", "test")
    )
    if not files:
        raise FileNotFoundError(f"{source}: no train/test .jsonl or .parquet files in it")
    return files


def write_rows(rows: list[dict], path: Path) -> None:
    if path.suffix == ".jsonl":
        with path.open("w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)


def convert(source: Path, output: Path, fmt: str = "parquet") -> dict[str, tuple[Path, int]]:
    """Convert every split found at ``source``; returns split -> (written file, rows)."""
    by_split: dict[str, list[dict]] = {}
    for path in input_files(source):
        split = split_of(path)
        rows = by_split.setdefault(split, [])
        for number, row in enumerate(read_rows(path), start=1):
            try:
                rows.append(convert_row(row, split, len(rows)))
            except (KeyError, ValueError) as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    output.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, rows in by_split.items():
        path = output / f"{split}.{fmt}"
        write_rows(rows, path)
        written[split] = (path, len(rows))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, required=True, help="a GSM8K file or directory")
    parser.add_argument("--output", type=Path, required=True, help="directory to write into")
    parser.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    args = parser.parse_args(argv)
    try:
        written = convert(args.input, args.output, args.format)
    except (OSError, ValueError) as error:
        print(f"gsm8k.py: {error}", file=sys.stderr)
        return 1
    for split, (path, count) in written.items():
        print(f"{split}: {count} rows -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
