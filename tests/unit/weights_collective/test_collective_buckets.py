"""Buckets and headers of the collective path: the layout by hand, forged headers refused."""

from __future__ import annotations

import pytest
import torch

from asyncrl.core.messages import TensorEntry
from asyncrl.core.signing import SIGNATURE_BYTES, group_key_pair
from asyncrl.weights.collective.buckets import (
    Accept,
    Ask,
    Bucket,
    BucketTensor,
    Offer,
    Spec,
    UpToDate,
    check_offer,
    in_pieces,
    piece_ranges,
    plan_buckets,
    plan_slot_buckets,
    seal,
    unseal,
)
from asyncrl.weights.collective.receiver import bucket_views
from asyncrl.weights.shm.segment import aligned_layout
from asyncrl.weights.source import WeightTransferError

LEARNER, REPLICA = group_key_pair(b"L" * 32, b"G" * 32)
"""The two sides of one group: each signs with its own key, checks the other's."""


def entries() -> list[TensorEntry]:
    """a f32 (2,3) = 24 B, b bf16 (4,) = 8 B, c f32 (5,) = 20 B, d f32 (10,) = 40 B."""
    return [
        TensorEntry("a", "float32", (2, 3), 0, 24),
        TensorEntry("b", "bfloat16", (4,), 24, 8),
        TensorEntry("c", "float32", (5,), 32, 20),
        TensorEntry("d", "float32", (10,), 52, 40),
    ]


def test_plan_packs_one_dtype_per_bucket_in_index_order_up_to_bucket_bytes():
    # 48 bytes: a (24) + c (20) = 44 fit; d (40) would make 84, so it opens a new bucket
    plan = plan_buckets(entries(), 48)
    assert [(bucket.dtype, bucket.nbytes, indices) for bucket, indices in plan] == [
        ("float32", 44, [0, 2]),
        ("bfloat16", 8, [1]),
        ("float32", 40, [3]),
    ]
    assert plan[0][0].tensors == (BucketTensor("a", (2, 3), 0), BucketTensor("c", (5,), 24))


def test_a_tensor_larger_than_a_bucket_is_a_bucket_of_its_own():
    plan = plan_buckets(entries(), 16)  # every f32 tensor is over 16 bytes
    # a bucket goes out when the next tensor of its dtype does not fit; the ones still
    # open at the end go in the order they were opened (bf16 at b, f32 again at d)
    assert [(b.nbytes, [t.name for t in b.tensors]) for b, _ in plan] == [
        (24, ["a"]),
        (20, ["c"]),
        (8, ["b"]),
        (40, ["d"]),
    ]


def offer(version: int = 3) -> Offer:
    return Offer(version, 12.5, tuple(bucket for bucket, _ in plan_buckets(entries(), 48)))


EXPECTED = {
    "a": Spec((2, 3), "float32"),
    "b": Spec((4,), "bfloat16"),
    "c": Spec((5,), None),
    "d": Spec(None, None),
}


def test_a_consistent_offer_is_accepted():
    check_offer(offer(), 2, EXPECTED, set(), 48)
    check_offer(offer(), 2, None, set(), 48)  # names unknown here: the engine checks them


def forged(buckets) -> Offer:
    return Offer(3, 0.0, tuple(buckets))


F32 = "float32"


@pytest.mark.parametrize(
    ("bad", "expected", "says"),
    [
        (forged([Bucket(F32, 24, (BucketTensor("a", (2, 3), 4),))]), None, "at byte 4, not 0"),
        (forged([Bucket(F32, 28, (BucketTensor("a", (2, 3), 0),))]), None, "says 28 bytes"),
        (forged([Bucket("complex64", 24, (BucketTensor("a", (2, 3), 0),))]), None, "dtype"),
        (forged([Bucket(F32, 4, (BucketTensor("a", (-1,), 0),))]), None, "shape (-1,)"),
        (
            forged([Bucket(F32, 48, (BucketTensor("a", (6,), 0), BucketTensor("a", (6,), 24)))]),
            None,
            "sent twice",
        ),
        (
            forged([Bucket(F32, 64, (BucketTensor("x", (8,), 0), BucketTensor("y", (8,), 32)))]),
            None,
            "over 48",
        ),
        (forged([Bucket(F32, 4, (BucketTensor("zz", (1,), 0),))]), EXPECTED, "not one of"),
        (forged([Bucket(F32, 24, (BucketTensor("a", (3, 2), 0),))]), EXPECTED, "expected (2, 3)"),
        (forged([Bucket("float16", 12, (BucketTensor("a", (2, 3), 0),))]), EXPECTED, "is float16"),
        (forged([Bucket(F32, 24, (BucketTensor("a", (2, 3), 0),))]), EXPECTED, "missing ['b', 'c'"),
    ],
)
def test_a_forged_offer_is_refused_naming_the_problem(bad, expected, says):
    with pytest.raises(WeightTransferError, match="refused v3") as refused:
        check_offer(bad, 2, expected, set(), 48)
    assert says in str(refused.value)


def test_an_offer_not_newer_than_the_held_version_is_refused():
    with pytest.raises(WeightTransferError, match="not newer than v3"):
        check_offer(offer(3), 3, EXPECTED, set(), 48)


def test_an_optional_tensor_may_be_missing():
    without_d = Offer(3, 0.0, offer().buckets[:2])
    check_offer(without_d, 2, EXPECTED, {"d"}, 48)
    with pytest.raises(WeightTransferError, match=r"missing \['d'\]"):
        check_offer(without_d, 2, EXPECTED, set(), 48)


def test_a_sealed_message_opens_only_with_its_key_and_context():
    data = seal(Ask(7), REPLICA, "ask:1:0")
    assert unseal(data, LEARNER, "ask:1:0", Ask) == Ask(7)
    other_run, _ = group_key_pair(b"X" * 32, b"Y" * 32)
    with pytest.raises(WeightTransferError, match="forged or misdirected"):
        unseal(data, other_run, "ask:1:0", Ask)  # another run's key
    with pytest.raises(WeightTransferError, match="forged or misdirected"):
        unseal(data, LEARNER, "ask:1:1", Ask)  # replayed to the next ask
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(WeightTransferError, match="forged or misdirected"):
        unseal(flipped, LEARNER, "ask:1:0", Ask)
    with pytest.raises(WeightTransferError, match="got Ask"):
        unseal(data, LEARNER, "ask:1:0", Offer | UpToDate)
    with pytest.raises(WeightTransferError, match="a 3-byte message"):
        unseal(b"abc", LEARNER, "ask:1:0", Ask)


def test_a_replica_s_key_cannot_speak_as_the_learner():
    """Every generator holds the replicas' key: what it signs must never pass for the
    learner's (an Accept seating it as rank 0, an Offer of its own version)."""
    learner_says = {
        "accept:" + "n" * 32: Accept(5, "n" * 32, 2),
        "reply:1:0": offer(),
        "reply:1:1": UpToDate(9),
    }
    for context, message in learner_says.items():
        genuine = seal(message, LEARNER, context)
        assert unseal(genuine, REPLICA, context, type(message)) == message
        forged = seal(message, REPLICA, context)
        with pytest.raises(WeightTransferError, match="forged or misdirected"):
            unseal(forged, REPLICA, context, type(message))
    # and the learner does not take its own words back as a replica's
    with pytest.raises(WeightTransferError, match="forged or misdirected"):
        unseal(seal(Ask(3), LEARNER, "ask:1:0"), LEARNER, "ask:1:0", Ask)


def test_without_a_key_messages_still_decode_strictly():
    data = seal(UpToDate(4), None, "reply:0:0")
    assert unseal(data, None, "reply:0:0", UpToDate) == UpToDate(4)
    with pytest.raises(WeightTransferError, match="malformed"):
        unseal(bytes(SIGNATURE_BYTES) + b"\x93\x01\x02", None, "reply:0:0", UpToDate)


def test_bucket_views_read_each_tensor_where_the_header_puts_it():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    c = torch.tensor([10.0, 11, 12, 13, 14])
    flat = torch.cat([a.reshape(-1).view(torch.uint8), c.view(torch.uint8)])  # 24 + 20 bytes
    b = torch.tensor([1.5, -2.0, 0.25, 8.0], dtype=torch.bfloat16)
    d = torch.arange(10, dtype=torch.float32) * -1
    buckets = [flat, b.view(torch.uint8), d.view(torch.uint8)]
    views = bucket_views(offer(), buckets)
    assert torch.equal(views["a"], a) and torch.equal(views["c"], c)
    assert views["b"].dtype == torch.bfloat16 and torch.equal(views["b"], b)
    assert torch.equal(views["d"], d)
    assert views["c"].data_ptr() == flat.data_ptr() + 24  # a view, not a copy


def slot_entries() -> list[TensorEntry]:
    """As a shm slot holds them: each at a 64-byte boundary (a: 0, b: 64, c: 128, d: 192,
    e: 256)."""
    return aligned_layout(
        [
            ("a", "float32", (2, 3)),
            ("b", "float32", (5,)),
            ("c", "bfloat16", (4,)),
            ("d", "float32", (40,)),
            ("e", "float32", (3,)),
        ]
    )


def test_slot_buckets_are_byte_ranges_of_runs_of_one_dtype_with_the_gaps_inside():
    planned = plan_slot_buckets(slot_entries(), 100, first_piece=100)
    # a and b (64 + 20 bytes), then c alone (its dtype), d alone (160 > 100: two pieces), e
    assert [(b.dtype, b.nbytes, b.pieces, start) for b, start in planned] == [
        ("float32", 84, (), 0),
        ("bfloat16", 8, (), 128),
        ("float32", 160, (100, 160), 192),
        ("float32", 12, (), 384),
    ]
    first = planned[0][0]
    assert [(t.name, t.offset) for t in first.tensors] == [("a", 0), ("b", 64)]
    offer = Offer(3, 0.0, tuple(bucket for bucket, _ in planned))
    check_offer(offer, 2, None, set(), 100)  # the alignment gap is allowed


def test_a_version_starts_in_small_pieces_that_double_up_to_the_bucket_size():
    sizes = [12, 4, 100, 64, 64, 200]
    buckets = [Bucket(F32, n, (BucketTensor(f"t{i}", (n // 4,), 0),)) for i, n in enumerate(sizes)]
    pieced = in_pieces(buckets, bucket_bytes=64, first_piece=4)
    # piece sizes 4, 8 (bucket 0), 16 (whole: 4), 32, 64 (bucket 2: 32 + 64 + 4),
    # then whole buckets of 64, and 64-byte pieces of the 200-byte one
    assert [b.pieces for b in pieced] == [(4, 12), (), (32, 96, 100), (), (), (64, 128, 192, 200)]
    assert [piece_ranges(b) for b in pieced[:2]] == [[(0, 4), (4, 12)], [(0, 4)]]
    assert max(b - a for bucket in pieced for a, b in piece_ranges(bucket)) <= 64
    assert piece_ranges(Bucket(F32, 0, ())) == []  # an empty bucket is no broadcast
    offer = Offer(3, 0.0, tuple(pieced))
    expected = {f"t{i}": Spec((n // 4,), F32) for i, n in enumerate(sizes)}
    check_offer(offer, 2, expected, set(), 64)


@pytest.mark.parametrize(
    "pieces",
    [(4, 8), (4, 4, 10), (6, 4, 10), (0, 10), (4, 12)],
    ids=["short", "repeated", "backwards", "empty piece", "past the end"],
)
def test_pieces_that_do_not_tile_the_bucket_are_refused(pieces):
    bucket = Bucket(F32, 10 * 4, (BucketTensor("a", (10,), 0),), tuple(p * 4 for p in pieces))
    with pytest.raises(WeightTransferError, match=r"pieces .* do not tile its 40 bytes"):
        check_offer(forged([bucket]), 2, None, set(), 1 << 20)


def test_a_gap_other_than_the_alignment_is_refused():
    gap = Bucket(F32, 44, (BucketTensor("a", (2, 3), 0), BucketTensor("b", (5,), 24 + 8)))
    with pytest.raises(WeightTransferError, match="'b' is at byte 32, not 24"):
        check_offer(forged([gap]), 2, None, set(), 100)
