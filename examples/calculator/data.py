"""Write the calculator task's prompts in the verl layout: train and held-out test.

Products of two three-digit numbers, which SmolLM2-135M-Instruct cannot work out
in its head but can get from the ``calculator`` tool of the built-in tool
environment (``configs/smollm2_tools.yaml``)::

    python examples/calculator/data.py --output data/calculator

Each prompt is a short conversation that shows the tool in use (two worked
examples as earlier turns: the question, the assistant's ``<tool_call>``, the
tool's answer, the assistant's reply), then the question; the config's
``tools_prompt`` adds a one-line listing to the system message. A model of this
size copies a format it has seen in earlier turns far more often than one it is
told about. Measured on SmolLM2, 24 first turns at temperature 0.8: 8 well-formed
calls behind the tool environment's full JSON-schema listing (427 prompt tokens),
12 behind a one-line listing like the config's (223), 22 with no listing at all (207); with the
listing alone and no examples, none in 24. The one-line listing leaves room to
learn, and RL starts there.

Each output row::

    prompt        [{"role": "user", "content": "What is 12 * 34?"},
                   {"role": "assistant", "content": "<tool_call>\\n{...}\\n</tool_call>"},
                   {"role": "tool", "content": "408"},
                   {"role": "assistant", "content": "12 * 34 = 408"},
                   ...,
                   {"role": "user", "content": "What is 517 * 238?"}]
    data_source   "calculator"           (scored by examples/calculator/reward.py)
    reward_model  {"style": "rule", "ground_truth": "123046"}
    extra_info    {"split", "index", "a", "b"}
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_SOURCE = "calculator"
SMALLEST, LARGEST = 100, 999
TRAIN, TEST = 2000, 128
EXAMPLES = ((12, 34), (250, 17))
"""The worked examples every prompt opens with (never asked as questions)."""


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def tool_call(expression: str) -> str:
    arguments = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(arguments)}\n</tool_call>"


def worked_example(a: int, b: int) -> list[dict[str, str]]:
    """One exchange that uses the tool: question, call, the tool's answer, the reply."""
    return [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": tool_call(f"{a} * {b}")},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": f"{a} * {b} = {a * b}"},
    ]


def row(a: int, b: int, split: str, index: int) -> dict:
    shown = [message for pair in EXAMPLES for message in worked_example(*pair)]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [*shown, {"role": "user", "content": question(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a * b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def splits(seed: int = 0) -> dict[str, list[dict]]:
    """``TRAIN`` and ``TEST`` distinct pairs, drawn with ``seed``; no pair in both."""
    rng = random.Random(seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set(EXAMPLES)
    while len(pairs) < TRAIN + TEST:
        pair = (rng.randint(SMALLEST, LARGEST), rng.randint(SMALLEST, LARGEST))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    named = {"test": pairs[:TEST], "train": pairs[TEST:]}
    return {
        split: [row(a, b, split, index) for index, (a, b) in enumerate(chosen)]
        for split, chosen in named.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("data/calculator"))
    parser.add_argument("--seed", type=int, default=0, help="which pairs are drawn and held out")
    args = parser.parse_args(argv)
    import pyarrow as pa
    import pyarrow.parquet as pq

    args.output.mkdir(parents=True, exist_ok=True)
    for split, rows in splits(args.seed).items():
        path = args.output / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        print(f"{path}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
