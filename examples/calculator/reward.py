"""The calculator task's reward (verl's signature): 1.0 when the final answer's last
number is the product, else 0.0.

``solution_str`` is the episode's last model turn, the one without a tool call (the
tool environment ends the episode there). Thousands separators are allowed
("123,046"); a wrong or missing number scores 0, so only a right answer pays, and a
model that cannot multiply three-digit numbers in its head gets there by the tool.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*")


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    numbers = [n.replace(",", "") for n in _NUMBER.findall(solution_str)]
    return 1.0 if numbers and numbers[-1] == str(ground_truth) else 0.0
