"""Token-budget micro-batches and rank balancing: every sample once, same count per rank."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.microbatch import balance, minibatch_plans, pack, padded_tokens, plan


def test_pack_respects_the_budget_and_sorts_by_length():
    lengths = [10, 3, 9, 4, 2]
    # longest first: [0, 2] costs 2 x 10 = 20; adding 3 (len 4) would cost 30 > 20
    assert pack(list(range(5)), lengths, max_tokens=20) == [[0, 2], [3, 1, 4]]


def test_a_sample_over_the_budget_goes_alone():
    assert pack([0, 1], [50, 5], max_tokens=16) == [[0], [1]]


def test_balance_deals_longest_first_to_the_lightest_rank():
    # 9 -> r0, 7 -> r1, 5 -> r1 (7 < 9), 3 -> r0 (9 < 12)
    assert balance([5, 9, 3, 7], world_size=2) == [[1, 2], [0, 3]]


def test_short_rank_gets_an_empty_pass_when_it_cannot_split():
    # rank 0 gets the 100-token sample alone; rank 1 needs 2 micro-batches for the rest
    layout = plan([100, 30, 30, 30, 30], world_size=2, max_tokens=64)
    assert [len(rank) for rank in layout] == [2, 2]
    assert [] in layout[0]


def test_minibatches_do_not_depend_on_the_number_of_ranks():
    lengths = [5, 9, 3, 7, 2, 8]
    for world_size in (1, 2, 3):
        plans = minibatch_plans(lengths, world_size, max_tokens=16, count=2)
        members = [sorted(i for rank in plan for rows in rank for i in rows) for plan in plans]
        assert members == [[0, 1, 2], [3, 4, 5]]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=40),
    world_size=st.integers(1, 4),
    max_tokens=st.integers(1, 256),
)
def test_plan_invariants(lengths, world_size, max_tokens):
    layout = plan(lengths, world_size, max_tokens)
    assert len(layout) == world_size
    assert len({len(rank) for rank in layout}) == 1  # FSDP needs equal counts
    seen = sorted(i for rank in layout for rows in rank for i in rows)
    assert seen == list(range(len(lengths)))  # every sample exactly once
    for rank in layout:
        for rows in rank:
            assert len(rows) <= 1 or padded_tokens(rows, lengths) <= max_tokens
    loads = [sum(lengths[i] for rows in rank for i in rows) for rank in layout]
    assert max(loads) - min(loads) <= max(lengths)  # LPT: within one sample


def test_plan_rejects_nothing_for_one_sample_many_ranks():
    layout = plan([7], world_size=3, max_tokens=4)
    assert sum(len(rows) for rank in layout for rows in rank) == 1
    assert all(len(rank) == 1 for rank in layout)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_minibatch_plans_cover_every_sample_once(count):
    lengths = list(range(1, 8))
    plans = minibatch_plans(lengths, world_size=2, max_tokens=8, count=count)
    assert len(plans) == count
    seen = sorted(i for plan in plans for rank in plan for rows in rank for i in rows)
    assert seen == list(range(7))
