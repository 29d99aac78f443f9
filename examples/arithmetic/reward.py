"""The arithmetic task's reward (verl's signature): 1.0 for the bare right number,
0.5 when the reply's last number is right, 0.0 otherwise.

The half credit keeps a signal where the model is right but wordy, so GRPO
can first find right answers and then learn to give them alone.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    reply = solution_str.strip().removesuffix(".").strip()
    if reply == ground_truth:
        return 1.0
    numbers = _NUMBER.findall(solution_str)
    return 0.5 if numbers and numbers[-1] == ground_truth else 0.0
