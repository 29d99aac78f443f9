"""What the buffer accepts from a generator (asyncrl.buffer.validation), rule by rule, and
the wire caps that come before any of it (asyncrl.core.messages.decode)."""

from __future__ import annotations

import logging
import math

import msgspec
import pytest

from asyncrl.buffer.peers import RejectionLog
from asyncrl.buffer.validation import (
    LOGPROB_MAX,
    MAX_POOLS,
    MAX_REWARD_ERROR_KINDS,
    MAX_STATS,
    Limits,
    check_pool,
    check_stats,
    model_vocab_size,
)
from asyncrl.config import load_config
from asyncrl.core.messages import (
    MAX_ARRAY_DIMS,
    SCHEMA_VERSION,
    BatchRequest,
    Heartbeat,
    Trajectories,
    WireError,
    WorkRequest,
    decode,
    encode,
)
from tests.helpers.buffer_validation import LIMITS, PROMPT, VOCAB, check, held_store, message


def reason(body, arrays, **options) -> str:
    with pytest.raises(WireError) as caught:
        check(body, arrays, **options)
    return caught.value.reason


# ------------------------------------------------------------------------ accepted


def test_a_generator_s_ordinary_message_passes_whole():
    body, arrays = message(group_ids=(0, 1))
    samples = check(body, arrays, store=held_store())
    keys = [(s.meta.group_id, s.meta.sample_index) for s in samples]
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(s.prompt_ids.tolist() == PROMPT for s in samples)


def test_rounding_just_above_zero_environment_tokens_and_the_next_version_pass():
    body, arrays = message()
    arrays["logprobs"][0] = LOGPROB_MAX / 2  # an engine's log-softmax rounding
    arrays["loss_mask"][1] = 0  # an environment's token: no version, log-prob 0
    arrays["token_versions"][1] = -1
    arrays["logprobs"][1] = 0.0
    arrays["token_versions"][2] = 2  # published, not yet asked for a batch with
    check(body, arrays, latest=2, store=held_store())


def test_samples_of_groups_the_sender_does_not_hold_pass_only_to_be_dropped_by_the_store():
    store = held_store()
    body, arrays = message(group_ids=(7,), prompt=[3, 3, 3])  # never handed out
    samples = check(body, arrays, store=store)
    assert store.ingest(samples) == 0
    assert store.counters["dropped_unknown_group"] == 2


def test_with_an_environment_a_sample_s_prompt_is_its_own_within_the_prompt_limit():
    own = Limits(**{**LIMITS.__dict__, "own_prompts": True})
    check(*message(prompt=[4] * 16), limits=own, store=held_store())
    assert reason(*message(prompt=[4] * 17), limits=own, store=held_store()) == "bad_lengths"


# ------------------------------------------------------------------------ refused


@pytest.mark.parametrize(
    ("field", "index", "value", "expected"),
    [
        ("prompt_ids", 0, VOCAB, "bad_tokens"),
        ("response_ids", 4, VOCAB, "bad_tokens"),
        ("response_ids", 0, -3, "bad_tokens"),
        ("logprobs", 2, math.nan, "bad_logprobs"),
        ("logprobs", 2, -math.inf, "bad_logprobs"),
        ("logprobs", 2, 0.5, "bad_logprobs"),
        ("logprobs", 2, -1e9, "bad_logprobs"),
        ("loss_mask", 1, 2, "bad_mask"),
        ("token_versions", 1, 3, "bad_version"),  # newer than anything published
        ("token_versions", 1, -1, "bad_version"),  # a model token without a version
        ("token_versions", 1, -2, "bad_version"),
        ("prompt_ids", 3, 9, "bad_prompt"),
    ],
)
def test_one_bad_token_refuses_the_whole_message(field, index, value, expected):
    body, arrays = message(group_ids=(0, 1))
    arrays[field][index] = value
    assert reason(body, arrays, latest=2, store=held_store()) == expected


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"reward": math.nan}, "bad_reward"),
        ({"reward": math.inf}, "bad_reward"),
        ({"reward": 1.5}, "bad_reward"),
        ({"reward": -1.01}, "bad_reward"),
        ({"response_len": 9}, "bad_lengths"),  # longer than max_new_tokens
        ({"prompt": [1, 2, 3]}, "bad_lengths"),  # not the prompt handed out
        ({"prompt": [2, 1]}, "bad_prompt"),
        ({"indices": [0, 0]}, "bad_index"),
        ({"indices": [2]}, "bad_index"),  # the group has 2 samples
        ({"indices": [-1]}, "bad_index"),
        ({"generate_time_s": math.nan}, "bad_field"),
        ({"generator_id": "bad id with spaces"}, "bad_field"),
        ({"reward_error": "x" * 100}, "bad_field"),
        ({"stats": {"made_up": 1.0}}, "bad_stats"),
    ],
    ids=str,
)
def test_a_sample_that_breaks_a_rule_refuses_the_message(options, expected):
    assert reason(*message(**options), store=held_store()) == expected


def test_samples_of_two_generators_in_one_message_are_refused():
    body, arrays = message(group_ids=(0, 1))
    metas = [
        msgspec.structs.replace(m, generator_id="gen-1") if i else m
        for i, m in enumerate(body.samples)
    ]
    assert reason(msgspec.structs.replace(body, samples=metas), arrays) == "bad_field"


def test_arrays_must_be_flat_and_add_up():
    body, arrays = message()
    arrays["response_ids"] = arrays["response_ids"].reshape(2, 3)
    assert reason(body, arrays) == "bad_array"
    body, arrays = message()
    arrays["logprobs"] = arrays["logprobs"][:-1]
    assert reason(body, arrays) == "bad_array"


def test_reward_error_kinds_are_counted_up_to_a_bound():
    kinds: set[str] = set()
    for k in range(MAX_REWARD_ERROR_KINDS):
        check(*message(reward_error=f"error:kind_{k}"), errors=kinds)
    check(*message(reward_error="error:kind_0"), errors=kinds)  # one seen before
    assert reason(*message(reward_error="error:one_more"), errors=kinds) == "bad_field"


def test_stats_are_known_finite_bounded_counters():
    check_stats({"samples_sent": 3.0, "env_tool_calls": 2.0, "restarts": 0.0}, "gen-0")
    check_stats({"restarts": 1.0}, "gen-0-r2")  # a restarted replica says so
    for stats, generator in [
        ({f"env_k{i}": 1.0 for i in range(MAX_STATS + 1)}, "gen-0"),
        ({"samples_sent": math.inf}, "gen-0"),
        ({"samples_sent": -1e16}, "gen-0"),
        ({"restarts": 1.0}, "gen-0"),
        ({"restarts": 2.0}, "gen-0-r2"),
        ({"Env_X": 1.0}, "gen-0"),
    ]:
        with pytest.raises(WireError) as caught:
            check_stats(stats, generator)
        assert caught.value.reason == "bad_stats", stats


def test_pool_names_are_bounded_in_form_and_number():
    known = {"default"}
    for i in range(MAX_POOLS - 1):
        check_pool(f"pool_{i}", known)
    check_pool("pool_0", known)
    for pool in ("one_too_many", "x" * 33, "a b", ""):
        with pytest.raises(WireError) as caught:
            check_pool(pool, known)
        assert caught.value.reason == "bad_pool"


# ------------------------------------------------------------------- the run's limits


def test_limits_come_from_the_config():
    config = load_config(
        None,
        [
            "model.tiny={}",
            "reward.min=-2",
            "reward.max=3",
            "generators.max_new_tokens=8",
            "generators.pools=[{name: a}, {name: b, max_new_tokens: 20}]",
        ],
    )
    limits = Limits.from_config(config, model_vocab_size(config))
    assert (limits.reward_min, limits.reward_max) == (-2.0, 3.0)
    assert limits.max_response_len == 20  # the longest pool's
    assert limits.vocab_size == 19  # the tiny model embeds its tokenizer
    assert not limits.own_prompts


def test_a_pretrained_model_s_vocab_size_is_read_from_its_config(tmp_path):
    from transformers import Qwen2Config

    from asyncrl.generation.tasks import build_tokenizer

    Qwen2Config(vocab_size=1234).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    config = load_config(None, [f"model.name_or_path={tmp_path}"])
    assert model_vocab_size(config) == 1234  # the embedding's rows, not the tokenizer's 19


# ------------------------------------------------------------------------ the wire


def header(arrays: list, body: dict | None = None) -> bytes:
    body = body or {"type": "trajectories", "samples": []}
    return msgspec.msgpack.encode(
        {"schema_version": SCHEMA_VERSION, "body": body, "arrays": arrays}
    )


def wire_reason(frames, **options) -> str:
    with pytest.raises(WireError) as caught:
        decode(frames, **options)
    return caught.value.reason


def test_an_array_of_too_many_or_too_large_dimensions_is_refused_while_decoding():
    dims = [1] * (MAX_ARRAY_DIMS + 1)
    assert wire_reason([header([["prompt_ids", "int32", dims]]), b"\0" * 4]) == "bad_array"
    assert wire_reason([header([["prompt_ids", "int32", [2**41]]]), b""]) == "bad_array"
    assert wire_reason([header([["prompt_ids", "int32", [-1]]]), b""]) == "bad_array"
    assert wire_reason([header([["prompt_ids", "int32", [2] * 100_000]]), b""]) == "bad_array"


def test_a_tensor_of_too_many_dimensions_is_refused_in_a_weights_manifest():
    body = {
        "type": "weights_manifest",
        "version": 1,
        "published_at": 0.0,
        "chunk_bytes": 16,
        "total_bytes": 4,
        "num_chunks": 1,
        "tensors": [["w", "float32", [1] * (MAX_ARRAY_DIMS + 1), 0, 4]],
    }
    assert wire_reason([header([], body)]) == "bad_header"


def test_a_header_over_the_receiver_s_limit_is_refused_before_it_is_decoded():
    frames = encode(Heartbeat("gen-0"))
    assert wire_reason(frames, max_header_bytes=len(frames[0]) - 1) == "oversized"
    assert decode(frames, max_header_bytes=len(frames[0]))[0] == Heartbeat("gen-0")


def test_rejections_are_logged_at_most_once_per_reason_per_interval(caplog):
    caplog.set_level(logging.WARNING, logger="asyncrl.buffer")
    logged = RejectionLog(every_s=10.0)
    for t in range(25):
        logged("bad_reward", f"bad_reward: number {t}", now=float(t))
        if t == 0:
            logged("bad_tokens", "bad_tokens: once", now=0.5)  # a reason of its own
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "rejected a message: bad_reward: number 0",
        "rejected a message: bad_tokens: once",
        "rejected a message: bad_reward: number 10 (and 9 more since the last such line)",
        "rejected a message: bad_reward: number 20 (and 9 more since the last such line)",
    ]


# ------------------------------------------------------------------- the service


def test_a_batch_the_learner_could_not_be_sent_goes_back_at_once():
    from tests.helpers.buffer_service import LEARNER, Recorded, samples_of

    class Unreachable(Recorded):
        async def _reply(self, identity: bytes, body, arrays=None) -> bool:
            await super()._reply(identity, body, arrays)
            return identity != LEARNER  # the learner's connection is gone

    buffer = Unreachable()
    try:
        buffer.handle(LEARNER, BatchRequest(policy_version=0))
        buffer.handle(b"g", WorkRequest("gen-g", 4))
        for item in buffer.last(b"g").items:
            buffer.handle(b"g", *samples_of(item, "gen-g"))
        assert isinstance(buffer.last(LEARNER), Trajectories)  # sent, never delivered
        assert buffer.store.counters["served"] == 0
        assert buffer.store.counters["returned_unconsumed"] == 4
        assert buffer.store.held_samples() == 4  # ready for the learner's next request
        assert buffer.learner.last_served_to is None  # and no abandoned request can return it again
    finally:
        buffer.close()
