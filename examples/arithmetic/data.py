"""Write the arithmetic task's prompts in the verl layout: train and held-out test.

Sums of two whole numbers from 0 to 15, asked as a chat message with the
instruction to reply with only the number. Every pair appears once: a seeded
quarter of them is the test split, which training never sees::

    python examples/arithmetic/data.py --output data/arithmetic

Each output row::

    prompt        [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "What is 7 + 5? Reply with only the number."}]
    data_source   "arithmetic"           (scored by examples/arithmetic/reward.py)
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "12"}
    extra_info    {"split", "index", "a", "b"}

With ``--text`` the prompt is plain text for a base model without a chat template
(``configs/gemma3_arithmetic.yaml``), the answer ending at the line's end
(``generators.stop: ["\n"]``)::

    prompt        "Question: What is 7 + 5?\nAnswer:"

and ``--one-shot`` puts a worked example before it (``"Question: What is 2 + 3?\nAnswer:
5\n"``), which shows a base model the answer's form.

SmolLM2-135M-Instruct, sampled at temperature 0.7, gets such a sum right about
half of the time, but almost never replies with the number alone: the reward
(examples/arithmetic/reward.py) pays 0.5 for a right final number and 1.0 for a
reply that is the right number and nothing else, so a group's samples differ in
reward and there is something to learn.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

DATA_SOURCE = "arithmetic"
SYSTEM = "Be brief."
LARGEST = 15
TEST_SHARE = 0.25


ONE_SHOT = "Question: What is 2 + 3?\nAnswer: 5\n"


def row(a: int, b: int, split: str, index: int, text: bool = False, shot: str = "") -> dict:
    question = f"What is {a} + {b}? Reply with only the number."
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {
        "data_source": DATA_SOURCE,
        "prompt": f"{shot}Question: What is {a} + {b}?\nAnswer:" if text else chat,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def splits(seed: int = 0, text: bool = False, shot: str = "") -> dict[str, list[dict]]:
    """Every pair (a, b) once, a seeded ``TEST_SHARE`` of them held out as ``test``."""
    pairs = [(a, b) for a in range(LARGEST + 1) for b in range(LARGEST + 1)]
    random.Random(seed).shuffle(pairs)
    cut = int(len(pairs) * TEST_SHARE)
    named = {"test": pairs[:cut], "train": pairs[cut:]}
    return {
        split: [row(a, b, split, index, text, shot) for index, (a, b) in enumerate(chosen)]
        for split, chosen in named.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("data/arithmetic"))
    parser.add_argument("--seed", type=int, default=0, help="which pairs are held out")
    parser.add_argument("--text", action="store_true", help="plain-text prompts (base models)")
    parser.add_argument("--one-shot", action="store_true", help="with --text: a worked example")
    args = parser.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.output.mkdir(parents=True, exist_ok=True)
    shot = ONE_SHOT if args.one_shot else ""
    for split, rows in splits(args.seed, args.text, shot).items():
        path = args.output / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        print(f"{path}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
