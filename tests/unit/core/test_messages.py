"""The wire format: a msgspec-typed msgpack header frame plus raw array frames."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
import zmq

from asyncrl.core.messages import (
    SCHEMA_VERSION,
    Ack,
    ArraySpec,
    BatchRequest,
    ErrorReply,
    TensorEntry,
    Trajectories,
    TrajectoryMeta,
    WeightsChunk,
    WeightsChunkRequest,
    WeightsGone,
    WeightsManifest,
    WeightsRequest,
    WeightsUpToDate,
    WireError,
    WorkGrant,
    WorkItem,
    WorkRequest,
    decode,
    encode,
    encode_raw,
)


def over_the_wire(frames) -> list[bytes]:
    """What a receiver gets: each frame as its own bytes, nothing shared with the sender."""
    return [bytes(frame) for frame in frames]


def header(body: dict, arrays: list | None = None, schema_version: int = SCHEMA_VERSION) -> bytes:
    """A hand-built header frame, for messages ``encode`` would never produce."""
    return msgspec.msgpack.encode(
        {"schema_version": schema_version, "body": body, "arrays": arrays or []}
    )


def reason_of(frames, **kwargs) -> str:
    with pytest.raises(WireError) as caught:
        decode(frames, **kwargs)
    return caught.value.reason


def two_samples() -> tuple[Trajectories, dict[str, np.ndarray]]:
    metas = [
        TrajectoryMeta(7, 0, 3, 2, 1.0, "stop", "gen-0", 0.25),
        TrajectoryMeta(7, 1, 3, 4, 0.5, "length", "gen-1"),
    ]
    arrays = {
        "prompt_ids": np.array([1, 5, 6, 1, 5, 6], dtype=np.int32),
        "response_ids": np.array([7, 2, 9, 8, 7, 2], dtype=np.int32),
        "logprobs": np.array([-0.1, -0.2, -1.5, -0.01, -3.0, -0.7], dtype=np.float32),
        "token_versions": np.array([3, 3, 2, 3, 3, 4], dtype=np.int32),
        "loss_mask": np.array([1, 1, 1, 1, 0, 1], dtype=np.uint8),
    }
    return Trajectories(metas, {"buffer_held": 12.0}), arrays


# --------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize(
    "body",
    [
        WorkRequest("gen-0", max_samples=16),
        WorkRequest("gen-0", max_samples=16, wait_s=1.5),
        WorkGrant(
            [
                WorkItem(7, 8, [1, 5, 6, 7, 3], "678", "synthetic/digits"),
                WorkItem(8, 8, [1, 0, 0, 9, 3], "110"),
            ],
            policy_version=3,
            retry_after_s=0.0,
        ),
        WorkGrant([], policy_version=5, retry_after_s=0.05),
        BatchRequest(policy_version=11),
        WeightsRequest(have_version=2),
        WeightsUpToDate(latest_version=4),
        WeightsChunkRequest(version=4, index=2),
        WeightsGone(version=3, latest_version=5),
        WeightsManifest(
            4,
            1.7e9,
            chunk_bytes=16,
            total_bytes=34,
            num_chunks=3,
            tensors=[
                TensorEntry("w", "float32", (2, 3), 0, 24),
                TensorEntry("b", "bfloat16", (5,), 24, 10),
                TensorEntry("empty", "float32", (0, 4), 34, 0),
            ],
        ),
        Ack(accepted=6, rejected=2),
        ErrorReply("bad_header", "Expected `int`, got `str`"),
    ],
    ids=lambda body: type(body).__name__,
)
def test_header_only_message_decodes_equal_to_what_was_encoded(body):
    frames = encode(body)

    decoded, arrays = decode(over_the_wire(frames))

    assert len(frames) == 1
    assert type(decoded) is type(body)
    assert decoded == body
    assert arrays == {}


def test_trajectories_with_two_samples_round_trip_with_all_five_arrays():
    body, arrays = two_samples()

    decoded, received = decode(over_the_wire(encode(body, arrays)))

    assert decoded == body
    assert decoded.samples[1].generate_time_s == 0.0
    assert set(received) == set(Trajectories.ARRAYS)
    for name, array in arrays.items():
        got = received[name].numpy()
        assert got.dtype == array.dtype
        np.testing.assert_array_equal(got, array)


def test_a_weights_chunk_round_trips_a_float32_and_a_raw_bfloat16_frame():
    matrix = np.arange(6, dtype=np.float32).reshape(2, 3) / 7
    as_float = np.array([1.0, -2.5, 0.125, 3.0], dtype=np.float32)
    bf16 = (as_float.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    body = WeightsChunk(version=4, index=0, crc32=123456789)
    specs = [
        ArraySpec("layer.weight", "float32", (2, 3)),
        ArraySpec("layer.bias", "bfloat16", (4,)),
    ]

    frames = encode_raw(body, specs, [memoryview(matrix).cast("B"), bf16])
    decoded, received = decode(over_the_wire(frames))

    assert decoded == body
    assert list(received) == ["layer.weight", "layer.bias"]
    np.testing.assert_array_equal(received["layer.weight"].numpy(), matrix)
    assert received["layer.bias"].spec == ArraySpec("layer.bias", "bfloat16", (4,))
    assert bytes(received["layer.bias"].buffer) == bf16


def test_non_contiguous_arrays_are_sent_in_logical_order():
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4).T

    _, received = decode(over_the_wire(encode(WeightsChunk(1, 0, 0), {"w": matrix})))

    assert received["w"].spec.shape == (4, 3)
    np.testing.assert_array_equal(received["w"].numpy(), matrix)


def test_decode_accepts_zmq_frames_as_a_receiver_gets_them_with_copy_false():
    body, arrays = two_samples()
    frames = [zmq.Frame(bytes(frame)) for frame in encode(body, arrays)]

    decoded, received = decode(frames)

    assert decoded == body
    np.testing.assert_array_equal(received["logprobs"].numpy(), arrays["logprobs"])


def test_received_arrays_are_read_only_views():
    body, arrays = two_samples()

    _, received = decode(over_the_wire(encode(body, arrays)))

    with pytest.raises(ValueError):
        received["prompt_ids"].numpy()[0] = 99


# Golden bytes, captured from the encoder before asyncrl/core/messages.py was split into
# messages, wire and weight_messages (issue 16): peers built either side of a change
# must keep understanding each other, so the bytes themselves may not move.
GOLDEN_WORK_REQUEST = bytes.fromhex(
    "83ae736368656d615f76657273696f6e01a4626f647985a474797065ac776f726b5f72657175657374"
    "ac67656e657261746f725f6964a567656e2d30ab6d61785f73616d706c657310a6776169745f73cb3ff8"
    "000000000000ab696e6361726e6174696f6e07a661727261797390"
)
GOLDEN_WEIGHTS_MANIFEST = bytes.fromhex(
    "83ae736368656d615f76657273696f6e01a4626f647987a474797065b0776569676874735f6d616e6966"
    "657374a776657273696f6e04ac7075626c69736865645f6174cb4004000000000000ab6368756e6b5f62"
    "7974657310ab746f74616c5f627974657318aa6e756d5f6368756e6b7302a774656e736f72739195a177"
    "a7666c6f617433329202030018a661727261797390"
)
GOLDEN_TRAJECTORIES = [
    bytes.fromhex(
        "83ae736368656d615f76657273696f6e01a4626f647985a474797065ac7472616a6563746f72696573"
        "a773616d706c6573918aa867726f75705f696401ac73616d706c655f696e64657800aa70726f6d7074"
        "5f6c656e02ac726573706f6e73655f6c656e01a6726577617264cb3ff0000000000000ad66696e6973"
        "685f726561736f6ea473746f70ac67656e657261746f725f6964a567656e2d30af67656e6572617465"
        "5f74696d655f73cb0000000000000000ac7265776172645f6572726f72a0aa6576616c5f726f756e64"
        "ffa5737461747380a4706f6f6ca0ab696e6361726e6174696f6e00a66172726179739593aa70726f6d"
        "70745f696473a5696e743332910293ac726573706f6e73655f696473a5696e743332910193a86c6f67"
        "70726f6273a7666c6f61743332910193a96c6f73735f6d61736ba575696e7438910193ae746f6b656e"
        "5f76657273696f6e73a5696e7433329101"
    ),
    bytes.fromhex("0100000002000000"),
    bytes.fromhex("03000000"),
    bytes.fromhex("000000bf"),
    bytes.fromhex("01"),
    bytes.fromhex("02000000"),
]


def test_a_role_message_encodes_to_the_same_bytes_as_before_the_split():
    frames = encode(WorkRequest("gen-0", max_samples=16, wait_s=1.5, incarnation=7))
    assert over_the_wire(frames) == [GOLDEN_WORK_REQUEST]


def test_a_weights_manifest_encodes_to_the_same_bytes_as_before_the_split():
    manifest = WeightsManifest(
        4,
        2.5,
        chunk_bytes=16,
        total_bytes=24,
        num_chunks=2,
        tensors=[TensorEntry("w", "float32", (2, 3), 0, 24)],
    )
    assert over_the_wire(encode(manifest)) == [GOLDEN_WEIGHTS_MANIFEST]
    assert decode([GOLDEN_WEIGHTS_MANIFEST])[0] == manifest


def test_trajectories_with_arrays_encode_to_the_same_frames_as_before_the_split():
    arrays = {
        "prompt_ids": np.array([1, 2], np.int32),
        "response_ids": np.array([3], np.int32),
        "logprobs": np.array([-0.5], np.float32),
        "loss_mask": np.array([1], np.uint8),
        "token_versions": np.array([2], np.int32),
    }
    body = Trajectories([TrajectoryMeta(1, 0, 2, 1, 1.0, "stop", "gen-0")])
    assert over_the_wire(encode(body, arrays)) == GOLDEN_TRAJECTORIES
    decoded, frames = decode(GOLDEN_TRAJECTORIES)
    assert decoded == body
    assert frames["logprobs"].numpy().tolist() == [-0.5]


# --------------------------------------------------------------------------
# rejections


def test_no_frames_at_all_is_rejected_as_empty():
    assert reason_of([]) == "empty"


@pytest.mark.parametrize(
    "garbage",
    [b"", b"\xc1", b"not msgpack at all", b"\x00\x01\x02"],
    ids=["blank", "invalid-opcode", "text", "int"],
)
def test_garbage_header_bytes_are_rejected_as_bad_header(garbage):
    assert reason_of([garbage]) == "bad_header"


def test_unknown_message_type_is_rejected_as_unknown_type():
    frame = header({"type": "launch_missiles"})

    assert reason_of([frame]) == "unknown_type"


def test_wrongly_typed_field_is_rejected_naming_the_field_path():
    meta = {
        "group_id": "seven",
        "sample_index": 0,
        "prompt_len": 0,
        "response_len": 0,
        "reward": 1.0,
        "finish_reason": "stop",
        "generator_id": "gen-0",
    }
    frame = header({"type": "trajectories", "samples": [meta]})

    with pytest.raises(WireError) as caught:
        decode([frame])

    assert caught.value.reason == "bad_header"
    assert "$.body.samples[0].group_id" in str(caught.value)


def test_a_work_request_without_wait_s_asks_for_an_answer_at_once():
    # what a replica built before wait_s existed sends: the buffer must not hold it
    frame = header({"type": "work_request", "generator_id": "gen-0", "max_samples": 8})

    request, _ = decode([frame])

    assert request == WorkRequest("gen-0", max_samples=8, wait_s=0.0)


def test_missing_required_field_is_rejected_as_bad_header():
    assert reason_of([header({"type": "ack"})]) == "bad_header"


def test_unknown_field_in_a_body_is_rejected_as_bad_header():
    assert reason_of([header({"type": "ack", "accepted": 1, "evil": True})]) == "bad_header"


def test_other_schema_version_is_rejected_as_schema_version():
    frame = header({"type": "ack", "accepted": 1}, schema_version=99)

    with pytest.raises(WireError) as caught:
        decode([frame])

    assert caught.value.reason == "schema_version"
    assert "99" in str(caught.value)


def test_extra_frame_not_named_in_the_header_is_rejected_as_frame_count():
    frames = [*over_the_wire(encode(Ack(1))), b"\x00\x00\x00\x00"]

    assert reason_of(frames) == "frame_count"


def test_array_named_in_the_header_without_its_frame_is_rejected_as_frame_count():
    body, arrays = two_samples()
    frames = over_the_wire(encode(body, arrays))

    assert reason_of(frames[:-1]) == "frame_count"


def test_array_frame_missing_its_last_bytes_is_rejected_as_truncated():
    body, arrays = two_samples()
    frames = over_the_wire(encode(body, arrays))
    frames[-1] = frames[-1][:-1]

    assert reason_of(frames) == "truncated"


def test_array_frame_longer_than_its_shape_is_rejected_as_truncated():
    frames = over_the_wire(encode(WeightsChunk(1, 0, 0), {"w": np.zeros(3, dtype=np.float32)}))
    frames[1] += b"\x00\x00\x00\x00"

    assert reason_of(frames) == "truncated"


def test_declared_array_with_the_wrong_dtype_is_rejected_as_bad_array():
    body, arrays = two_samples()
    arrays["prompt_ids"] = arrays["prompt_ids"].astype(np.int64)

    with pytest.raises(WireError) as caught:
        decode(over_the_wire(encode(body, arrays)))

    assert caught.value.reason == "bad_array"
    assert "prompt_ids" in str(caught.value)


def test_array_the_message_does_not_declare_is_rejected_as_bad_array():
    body, arrays = two_samples()
    arrays["secret"] = np.zeros(2, dtype=np.int32)

    with pytest.raises(WireError) as caught:
        decode(over_the_wire(encode(body, arrays)))

    assert caught.value.reason == "bad_array"
    assert "secret" in str(caught.value)


def test_message_missing_a_declared_array_is_rejected_as_bad_array():
    body, arrays = two_samples()
    del arrays["loss_mask"]

    with pytest.raises(WireError) as caught:
        decode(over_the_wire(encode(body, arrays)))

    assert caught.value.reason == "bad_array"
    assert "loss_mask" in str(caught.value)


def test_arrays_on_a_header_only_message_with_an_unsupported_dtype_are_rejected():
    frames = encode_raw(WeightsChunk(1, 0, 0), [ArraySpec("w", "complex64", (1,))], [b"\x00" * 8])

    assert reason_of(over_the_wire(frames)) == "bad_array"


def test_array_with_a_negative_dimension_is_rejected_as_bad_array():
    frames = encode_raw(WeightsChunk(1, 0, 0), [ArraySpec("w", "int32", (-1, -4))], [b"\x00" * 16])

    assert reason_of(over_the_wire(frames)) == "bad_array"


def test_array_whose_declared_size_overflows_int64_is_rejected_not_accepted_as_empty():
    frames = encode_raw(WeightsChunk(1, 0, 0), [ArraySpec("w", "int32", (2**32, 2**32))], [b""])

    assert reason_of(over_the_wire(frames)) == "truncated"


def test_message_larger_than_max_bytes_is_rejected_as_oversized():
    body, arrays = two_samples()
    frames = over_the_wire(encode(body, arrays))
    total = sum(len(frame) for frame in frames)

    assert reason_of(frames, max_bytes=total - 1) == "oversized"
    assert decode(frames, max_bytes=total)[0] == body


# --------------------------------------------------------------------------
# no pickle on the wire


def test_header_frame_is_msgpack_not_pickle():
    body, arrays = two_samples()

    frame = bytes(encode(body, arrays)[0])

    assert not frame.startswith(b"\x80")
    assert msgspec.msgpack.decode(frame)["body"]["type"] == "trajectories"


UNPICKLED: list[str] = []


def _record_unpickling(tag: str) -> str:
    UNPICKLED.append(tag)
    return tag


class _Payload:
    def __reduce__(self):
        return (_record_unpickling, ("ran",))


def test_a_pickled_message_is_rejected_and_never_unpickled():
    UNPICKLED.clear()
    pickled = pickle.dumps(
        {"schema_version": SCHEMA_VERSION, "body": {"type": "ack", "accepted": 1}, "x": _Payload()}
    )

    with pytest.raises(WireError) as caught:
        decode([pickled])

    assert caught.value.reason == "bad_header"
    assert UNPICKLED == []


def test_decoding_does_not_call_pickle(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("decode unpickled something")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    body, arrays = two_samples()

    decoded, received = decode(over_the_wire(encode(body, arrays)))

    assert decoded == body
    np.testing.assert_array_equal(received["token_versions"].numpy(), arrays["token_versions"])


def manifest_header(**changes) -> bytes:
    body = {
        "type": "weights_manifest",
        "version": 1,
        "published_at": 0.0,
        "chunk_bytes": 16,
        "total_bytes": 34,
        "num_chunks": 3,
        "tensors": [["w", "float32", [2, 3], 0, 24], ["b", "bfloat16", [5], 24, 10]],
    }
    return header({**body, **changes})


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"tensors": [["w", "float32", [2, 3], 0, 20]]}, "tensor 'w'"),
        ({"tensors": [["w", "float32", [2, 3], 0, 24], ["b", "bfloat16", [5], 28, 10]]}, "'b'"),
        ({"tensors": [["w", "float32", [2, 3], 0, 24], ["w", "bfloat16", [5], 24, 10]]}, "twice"),
        ({"tensors": [["w", "complex64", [2], 0, 16]]}, "unsupported"),
        ({"total_bytes": 40}, "total_bytes"),
        ({"num_chunks": 2}, "chunks"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
    ],
    ids=["size", "gap", "duplicate", "dtype", "total", "chunk-count", "chunk-size"],
)
def test_a_weights_manifest_whose_index_does_not_add_up_is_rejected(changes, complaint):
    with pytest.raises(WireError) as caught:
        decode([manifest_header(**changes)])

    assert caught.value.reason == "bad_header"
    assert complaint in str(caught.value)


def test_a_consistent_weights_manifest_decodes():
    body, _ = decode([manifest_header()])

    assert isinstance(body, WeightsManifest)
    assert [entry.name for entry in body.tensors] == ["w", "b"]
