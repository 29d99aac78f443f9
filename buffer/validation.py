"""What the buffer accepts from a generator, whoever sent it: every rule, and its reason.

The buffer is the learner's only door: a sample it stores is trained on. So a
generator's message is checked whole before anything of it is stored, and a
message that breaks one rule is refused whole (``ErrorReply(reason)``, counted
as ``buffer_rejected_<reason>``). The rules, by reason:

``bad_array``
    the arrays are one-dimensional and as long as the samples' lengths add up to.
``bad_lengths``
    ``prompt_len >= 1``, ``response_len >= 0``; a response no longer than a
    generator may make (``generators.max_new_tokens``, the largest of the pools';
    with an environment ``environment.max_total_tokens``); a prompt as long as the
    prompt handed out (with an environment, which renders its own prompt: at most
    ``data.max_prompt_tokens``, or the prompt handed out when that is longer).
``bad_prompt``
    without an environment, a sample's prompt ids are the ones its group was handed
    out with.
``bad_tokens``
    every prompt and response token id is in ``[0, vocab_size)``, the policy's
    embedding rows (:func:`model_vocab_size`).
``bad_logprobs``
    every log-prob is finite and in ``[LOGPROB_MIN, LOGPROB_MAX]``.
``bad_mask``
    every loss-mask value is 0 or 1.
``bad_version``
    a model token (mask 1) has a weight version in ``[0, latest]``, a token an
    environment added (mask 0) ``-1`` or one in that range, where ``latest`` is
    the newest version the learner can have published (the buffer's version + 1:
    the learner publishes a version before it asks for its batch).
``bad_reward``
    every reward is finite and in ``[reward.min, reward.max]``.
``bad_index``
    a sample index is not repeated within the message, and is below the group's
    ``num_samples`` when the group is the sender's.
``bad_field``
    every sample names the sending generator; finish reasons and reward-error tags
    are short lower-case words (``error:timeout``), and at most
    ``MAX_REWARD_ERROR_KINDS`` distinct tags are ever counted; a finite generate time;
    an episode's counts (``TrajectoryMeta.episode``) have at least one turn and no more
    tool errors than tool calls.
``bad_stats``
    at most ``MAX_STATS`` entries, each a counter a replica reports
    (``REPLICA_STATS``, or ``env_<word>``) with a finite value of magnitude at most
    ``MAX_STAT_VALUE``; ``restarts`` is 0, or 1 from a restarted replica's id
    (``gen-0-r2``).
``bad_pool``
    a pool name as the config allows one (``^[A-Za-z0-9_-]{1,32}$``), and at most
    ``MAX_POOLS`` distinct ones.

Samples for groups the sender does not hold (late, or never handed out) pass
these rules only to be dropped and counted by the store, as before.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from asyncrl.core.messages import EpisodeCounts, Trajectories, TrajectoryMeta, WireError, WorkItem
from asyncrl.core.reductions import Reduce
from asyncrl.core.trajectory import (
    ENV_VERSION,
    ColumnLengthError,
    Columns,
    Sample,
    is_model_token,
    split_samples,
)
from asyncrl.core.weight_messages import WEIGHT_SYNC_STATS

if TYPE_CHECKING:
    from asyncrl.config import Config

log = logging.getLogger("asyncrl.buffer")

LOGPROB_MAX = 1e-3
"""The highest log-prob accepted: 0 (probability 1) plus rounding in the engine's
log-softmax, which can land a hair above 0 in float32 or bfloat16."""
LOGPROB_MIN = -1e4
"""The lowest log-prob accepted. A token a float32 (or bfloat16) sampler can draw has a
probability above ~1e-45, a log-prob above -104; environment tokens carry 0."""
MAX_STATS = 64
"""Entries in one message's ``stats``: a replica reports about 11, plus ``env_*`` ones."""
MAX_STAT_VALUE = 1e15
"""The largest magnitude of one reported counter (samples, seconds, swaps)."""
REPLICA_STATS: dict[str, Reduce] = {
    "samples_sent": Reduce.SUM,
    "weight_swaps": Reduce.SUM,
    "weight_swap_latency_s": Reduce.MEAN,  # the latest swap's, per replica
    "weight_load_s": Reduce.MEAN,  # likewise
    "reward_errors": Reduce.SUM,
    "eval_samples_sent": Reduce.SUM,
    "busy_s": Reduce.SUM,
    "wall_s": Reduce.SUM,
    "chunks": Reduce.SUM,
    "chunk_s_max": Reduce.MAX,  # the replica's longest engine call
    "restarts": Reduce.SUM,
    **dict.fromkeys(WEIGHT_SYNC_STATS, Reduce.SUM),  # the weight-sync chain's counters
}
"""The counters a replica sends with its samples (``GeneratorReplica.stats``), each with
how values of several replicas combine; its multi-turn episodes add ``env_<counter>``
(sums)."""
ENV_STAT = re.compile(r"env_[a-z0-9_]{1,48}")


def replica_stat_reduce(key: str) -> Reduce:
    """How a replica counter's values from several replicas combine (``env_*``: sums)."""
    return REPLICA_STATS.get(key, Reduce.SUM)


RESTARTED_ID = re.compile(r".*-r[1-9][0-9]*")
"""The id the launcher gives a restarted replica (``gen-0-r2``): only it reports
``restarts = 1``."""
POOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")
"""A pool's name, as ``generators.pools[].name`` allows it."""
MAX_POOLS = 32
"""Distinct pool names the buffer reports on (``pool_<name>_*``): the config's, then the
first ones generators name, up to this many."""
GENERATOR_ID = re.compile(r"[A-Za-z0-9_.:@+-]{1,128}")
"""A generator id: ``gen-0``, ``gen-0-r2``, ``fast-1``, ``extra-HOST-PID``."""
FINISH_REASON = re.compile(r"[a-z_]{1,32}")
REWARD_ERROR = re.compile(r"error:[a-z0-9_]{1,40}")
MAX_REWARD_ERROR_KINDS = 32
"""Distinct reward-error tags the buffer counts (``buffer_reward_error_*``)."""


@dataclass(frozen=True)
class Limits:
    """The bounds a run's samples fall within, from its config (:meth:`from_config`)."""

    vocab_size: int | None
    """Token ids must be below it; None: unknown (only ``>= 0`` is checked)."""
    reward_min: float
    reward_max: float
    max_response_len: int
    max_prompt_len: int
    """The longest prompt a generator may send for a group when it renders its own
    (an environment); without one a sample's prompt is the one handed out."""
    own_prompts: bool
    """An environment renders each episode's prompt: prompt ids need not equal the
    ones handed out."""

    @classmethod
    def from_config(cls, config: Config, vocab_size: int | None) -> Limits:
        environment = config.environment
        if environment is None:
            longest = max(p.settings.max_new_tokens for p in config.generators.resolved_pools())
        else:
            longest = environment.max_total_tokens
        return cls(
            vocab_size=vocab_size,
            reward_min=config.reward.min,
            reward_max=config.reward.max,
            max_response_len=longest,
            max_prompt_len=config.data.max_prompt_tokens,
            own_prompts=environment is not None,
        )


def model_vocab_size(config: Config) -> int | None:
    """The number of token ids the policy embeds: what a generator can sample.

    The built-in tiny model embeds exactly its tokenizer (``len(tokenizer)``). A
    Hugging Face model's (or GGUF file's) config says ``vocab_size``, read from its
    ``config.json`` (or the GGUF header) without loading any weight; it may exceed
    the tokenizer's length (padded embeddings), and the learner's embedding accepts
    any id below it. If the config cannot be read, the tokenizer's length stands in;
    if neither can, None (logged): token ids are then only checked to be ``>= 0``.
    """
    from asyncrl.generation.tasks import build_tokenizer, prompt_tokenizer

    name = config.model.name_or_path
    if name is None:
        return len(build_tokenizer())
    try:
        from transformers import AutoConfig

        path = Path(name)
        if path.suffix.lower() == ".gguf":
            model_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            model_config = AutoConfig.from_pretrained(name)
        return int(model_config.get_text_config().vocab_size)
    except Exception as error:
        log.warning(
            "cannot read vocab_size from %s (%s); using its tokenizer's length", name, error
        )
    try:
        return len(prompt_tokenizer(config))
    except Exception as error:
        log.error(
            "the buffer cannot tell %s's vocabulary size (%s): token ids are only checked "
            "to be >= 0",
            name,
            error,
        )
        return None


# ---------------------------------------------------------------------- fields


def check_generator_id(generator_id: str) -> None:
    if not GENERATOR_ID.fullmatch(generator_id):
        raise WireError(
            "bad_field",
            f"generator id {generator_id[:40]!r} must match {GENERATOR_ID.pattern}",
        )


def check_pool(pool: str, known: set[str]) -> None:
    """``pool`` is a valid name and, if new, there is room for it in ``known`` (added)."""
    if not POOL_NAME.fullmatch(pool):
        raise WireError("bad_pool", f"pool {pool[:40]!r} must match {POOL_NAME.pattern}")
    if pool not in known:
        if len(known) >= MAX_POOLS:
            raise WireError("bad_pool", f"pool {pool!r}: the buffer knows {MAX_POOLS} already")
        known.add(pool)


def check_stats(stats: Mapping[str, float], generator_id: str) -> None:
    """A replica's reported counters: known names, finite bounded values (``bad_stats``)."""
    if len(stats) > MAX_STATS:
        raise WireError("bad_stats", f"{len(stats)} entries, at most {MAX_STATS}")
    for key, value in stats.items():
        if key not in REPLICA_STATS and not ENV_STAT.fullmatch(key):
            raise WireError("bad_stats", f"unknown counter {key[:40]!r}")
        if not math.isfinite(value) or abs(value) > MAX_STAT_VALUE:
            raise WireError("bad_stats", f"{key} = {value} is not a finite, bounded number")
    restarts = stats.get("restarts", 0.0)
    if restarts not in (0.0, 1.0) or (restarts and not RESTARTED_ID.fullmatch(generator_id)):
        raise WireError(
            "bad_stats",
            f"restarts = {restarts} from {generator_id!r}: 1 only from a restarted "
            "replica's id (NAME-rN), else 0",
        )


# --------------------------------------------------------------------- samples


def sender_of(body: Trajectories) -> str:
    """The one generator every sample of ``body`` names (``""`` for no samples)."""
    senders = {meta.generator_id for meta in body.samples}
    if len(senders) > 1:
        raise WireError("bad_field", f"samples of {len(senders)} generators in one message")
    sender = next(iter(senders), "")
    if body.samples:
        check_generator_id(sender)
    return sender


def check_trajectories(
    body: Trajectories,
    arrays: Mapping[str, np.ndarray],
    limits: Limits,
    latest_version: int,
    handed_out: Callable[[TrajectoryMeta], WorkItem | None],
    reward_errors: set[str],
) -> list[Sample]:
    """A generator's Trajectories, checked whole: its samples.

    ``handed_out(meta)`` is the WorkItem of the sample's group when that group is
    in flight to the sample's generator, else None. ``reward_errors``: the tags
    counted so far (a new one is added). Raises :class:`WireError` naming the
    first rule broken; nothing is stored by this function.
    """
    metas = body.samples
    sender = sender_of(body)
    check_stats(body.stats, sender)
    for name, array in arrays.items():
        if array.ndim != 1:
            raise WireError("bad_array", f"{name} must be one-dimensional, has shape {array.shape}")
    _check_metas(metas, limits, reward_errors)
    columns = Columns.from_wire(arrays)
    try:
        samples = split_samples(metas, columns)
    except ColumnLengthError as error:
        raise WireError("bad_array", str(error)) from None
    _check_tokens(columns, limits, latest_version)
    seen: set[tuple[int, int]] = set()
    for sample in samples:
        meta = sample.meta
        key = (meta.group_id, meta.sample_index)
        if key in seen:
            raise WireError("bad_index", f"sample {key} appears twice")
        seen.add(key)
        item = handed_out(meta)
        if item is not None:
            _check_against_item(sample, item, limits)
    return samples


def _check_metas(metas: list[TrajectoryMeta], limits: Limits, reward_errors: set[str]) -> None:
    for meta in metas:
        where = f"sample ({meta.group_id}, {meta.sample_index})"
        if meta.prompt_len < 1 or meta.response_len < 0:
            raise WireError(
                "bad_lengths",
                f"{where}: prompt_len {meta.prompt_len}, response {meta.response_len}",
            )
        if meta.response_len > limits.max_response_len:
            raise WireError(
                "bad_lengths",
                f"{where}: {meta.response_len} response tokens, at most {limits.max_response_len}",
            )
        if meta.sample_index < 0:
            raise WireError("bad_index", f"{where}: a negative sample index")
        if not (
            math.isfinite(meta.reward) and limits.reward_min <= meta.reward <= limits.reward_max
        ):
            raise WireError(
                "bad_reward",
                f"{where}: reward {meta.reward} is outside [reward.min, reward.max] = "
                f"[{limits.reward_min}, {limits.reward_max}]",
            )
        if not FINISH_REASON.fullmatch(meta.finish_reason):
            raise WireError("bad_field", f"{where}: finish reason {meta.finish_reason[:40]!r}")
        if not math.isfinite(meta.generate_time_s):
            raise WireError("bad_field", f"{where}: generate time {meta.generate_time_s}")
        _check_episode(meta.episode, where)
        error = meta.reward_error
        if error and error not in reward_errors:
            if not REWARD_ERROR.fullmatch(error):
                raise WireError("bad_field", f"{where}: reward error {error[:40]!r}")
            if len(reward_errors) >= MAX_REWARD_ERROR_KINDS:
                raise WireError("bad_field", f"{where}: too many kinds of reward error")
            reward_errors.add(error)


def _check_episode(counts: EpisodeCounts | msgspec.UnsetType, where: str) -> None:
    """Counts that could be true: the per-batch figures are means over them, so one
    impossible sample would skew a step's line with no sign of where it came from."""
    if counts is msgspec.UNSET:
        return
    if counts.turns == 0:
        raise WireError(
            "bad_field", f"{where}: episode.turns is 0 (an episode with no turn sends no counts)"
        )
    if counts.tool_errors > counts.tool_calls:
        raise WireError(
            "bad_field",
            f"{where}: episode.tool_errors {counts.tool_errors} > episode.tool_calls "
            f"{counts.tool_calls}",
        )


def _check_tokens(columns: Columns, limits: Limits, latest_version: int) -> None:
    """Every token of the message at once (numpy, one pass per rule)."""
    for part, ids in (("prompt", columns.prompt_ids), ("response", columns.response_ids)):
        if ids.size and (
            int(ids.min()) < 0
            or (limits.vocab_size is not None and int(ids.max()) >= limits.vocab_size)
        ):
            raise WireError(
                "bad_tokens",
                f"{part} token ids are in [{int(ids.min())}, {int(ids.max())}], "
                f"the vocabulary is [0, {limits.vocab_size})",
            )
    logprobs = columns.logprobs
    if logprobs.size:
        finite = bool(np.isfinite(logprobs).all())
        low, high = (float(logprobs.min()), float(logprobs.max())) if finite else (0.0, 0.0)
        if not finite or low < LOGPROB_MIN or high > LOGPROB_MAX:
            raise WireError(
                "bad_logprobs",
                f"log-probs must be finite and in [{LOGPROB_MIN}, {LOGPROB_MAX}], got "
                + (f"[{low}, {high}]" if finite else "a non-finite one"),
            )
    mask = columns.loss_mask
    if mask.size and int(mask.max()) > 1:
        raise WireError("bad_mask", f"loss mask values must be 0 or 1, got {int(mask.max())}")
    versions = columns.token_versions
    if versions.size:
        # the loss mask and the version must agree that a trained token is the model's
        trained = versions[mask == 1]
        unversioned = bool(trained.size) and not bool(is_model_token(trained).all())
        if unversioned or int(versions.min()) < ENV_VERSION or int(versions.max()) > latest_version:
            raise WireError(
                "bad_version",
                f"token versions must be in [0, {latest_version}] (environment tokens may be "
                f"{ENV_VERSION}), got [{int(versions.min())}, {int(versions.max())}]"
                + (f" with {ENV_VERSION} on a model token" if unversioned else ""),
            )


def _check_against_item(sample: Sample, item: WorkItem, limits: Limits) -> None:
    """A sample of a group the sender holds: its index and prompt fit what was handed out."""
    meta = sample.meta
    where = f"sample ({meta.group_id}, {meta.sample_index})"
    if meta.sample_index >= item.num_samples:
        raise WireError("bad_index", f"{where}: the group has {item.num_samples} samples")
    if limits.own_prompts:
        longest = max(limits.max_prompt_len, len(item.prompt_ids))
        if meta.prompt_len > longest:
            raise WireError("bad_lengths", f"{where}: a prompt of {meta.prompt_len} > {longest}")
        return
    if meta.prompt_len != len(item.prompt_ids):
        raise WireError(
            "bad_lengths",
            f"{where}: prompt_len {meta.prompt_len}, the prompt handed out has "
            f"{len(item.prompt_ids)} tokens",
        )
    if not np.array_equal(sample.prompt_ids, np.asarray(item.prompt_ids, dtype=np.int64)):
        raise WireError("bad_prompt", f"{where}: prompt ids differ from the prompt handed out")
