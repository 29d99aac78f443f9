"""A generator replica generates an eval round's prompts like training ones, one turn
or multi-turn, and sends their samples back tagged with the round.

The replica's real loop runs against a scripted backend and a buffer stand-in
that hands out one eval group and one training group, then nothing.
"""

from __future__ import annotations

import pytest

from tests.helpers.generators import run_replica


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        [
            "environment.name=tests.helpers.generators:CountdownEnv",
            "environment.formatter=plain",
            "environment.kwargs={turns: 2}",
        ],
    ],
    ids=["one turn", "multi-turn"],
)
def test_eval_samples_come_back_tagged_with_their_round_training_ones_untagged(overrides):
    samples = run_replica(*overrides)
    tags = sorted((meta.group_id, meta.sample_index, meta.eval_round) for meta in samples)
    assert tags == [(-1, 0, 3), (-1, 1, 3), (0, 0, -1), (0, 1, -1)]
    by_group = {meta.group_id: meta for meta in samples}
    # the same prompt, the same generation and scoring path: the same result
    assert by_group[-1].response_len == by_group[0].response_len > 0
    assert by_group[-1].reward == by_group[0].reward
