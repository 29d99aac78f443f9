"""The learner: pull a batch, update the policy, publish it, checkpoint, log. Repeat.

::

    buffer ──Trajectories──▶ rank 0 ──broadcast──▶ every rank: update (FSDP2)
           ◀─BatchRequest(V)─   │                       │
                                └◀──── full tensors ────┘──▶ Weights(V) ──▶ generators
                                └──▶ metrics.jsonl, aim

The policy's version ``V`` counts learner steps (batches trained on). The
batch handed over at version ``V`` holds no sample older than ``V -
max_staleness`` (the buffer's ``take_batch`` guarantees it; this loop reports
the staleness it actually got). Weights are published every
``sync_interval`` versions, and a checkpoint is written every
``checkpoint_every`` steps. A batch whose update is not finite (a NaN reward,
say) still counts as a step but changes no weight (:mod:`.update`,
``learner_skipped_nonfinite_total``); a checkpoint of non-finite weights is
refused, never marked complete (:mod:`.checkpoint`,
``learner_checkpoints_refused_total``).

SIGTERM (or SIGINT) stops the learner at a step boundary: rank 0 abandons a
batch it is still waiting for, or finishes the step it is training; every
rank then agrees to stop (:func:`stop_agreed`), the last complete step is
checkpointed with the buffer's state unless it already is, and the process
exits 0. Each step's group ids go to ``RUN_DIR/trained_groups.jsonl``, so
which prompts were trained can be checked across restarts, and so that a
checkpoint whose buffer part the buffer cannot write (it died: no answer
within ``FINAL_SAVE_TIMEOUT_S`` of a stop) is still completed, rank 0 writing
that part itself (:func:`.checkpoint.complete_without_buffer`). No wait for the
buffer outlasts a stop by more than ``FINAL_SAVE_TIMEOUT_S``.

A file of the run's record (``metrics.jsonl``, ``trained_groups.jsonl``) or a
checkpoint that cannot be written (a full disk) stops the learner at once with
one line naming the file and the error, and a non-zero status; aim failing only
turns aim off (:mod:`asyncrl.tracking`).

Held-out evaluation (``eval:``) never stops the loop: right after publishing
version ``V`` with ``V % eval.every_steps == 0`` (and at ``V = 0`` with
``eval.before_training``, and at the version a resumed run starts from when
one is due there), rank 0 tells the buffer to start round
``V // eval.every_steps`` (:class:`StartEval`). The generators do the work; the
round's ``eval_*`` results arrive with a later batch's buffer stats and are
logged at that step. No batch comes after the last step, so with
``eval.at_end`` the final policy is evaluated apart (:mod:`.final_eval`): rank 0
starts its round once training is done, waits for it (and for a round still
running) up to ``eval.final_timeout_s``, and logs it as one more line, after
saving the final policy so that the wait never holds the other ranks.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import zmq
from torch import nn

from asyncrl import progress
from asyncrl.config import Config
from asyncrl.learner import checkpoint, distributed, sharding
from asyncrl.learner.batch import TrainBatch, collate
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.final_eval import FINAL_EVAL, FinalEval
from asyncrl.learner.update import Update
from asyncrl.messages import (
    Ack,
    BatchRequest,
    EvalResults,
    EvalResultsRequest,
    SaveBufferState,
    StartEval,
    Trajectories,
    WireError,
)
from asyncrl.models import DTYPES, build_policy, empty_like
from asyncrl.paths import TRAINED_GROUPS, checkpoint_dir
from asyncrl.security import LEARNER, client_context
from asyncrl.tracking import JsonLines, RecordWriteError, Tracker
from asyncrl.transport import RequestClient, tcp
from asyncrl.weights import WeightPublisher

log = logging.getLogger("asyncrl.learner")

STOP_POLL_S = 0.2
"""While rank 0 waits for a batch, how often it checks whether it was asked to stop."""
FINAL_SAVE_TIMEOUT_S = 5.0
"""How long the checkpoint written on a stop waits for the buffer's part of it; also how
long any wait for the buffer lasts once a stop is asked (a dead buffer never holds it up)."""
START_EVAL_TIMEOUT_S = 30.0
"""How long starting an eval round waits for the buffer's answer (it answers at once)."""


class BufferStateNotSaved(RuntimeError):
    """The buffer did not save its part of a checkpoint: no answer in time, or a refusal."""


class BufferClient:
    """Rank 0's line to the buffer: batches (waiting however long generation takes)
    and the buffer's share of each checkpoint.

    Every wait for an answer checks ``stop`` (SIGTERM) every ``STOP_POLL_S``; once it
    is true, the wait lasts at most ``FINAL_SAVE_TIMEOUT_S`` more.
    """

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        pad_id: int,
        stop: Callable[[], bool] = lambda: False,
    ):
        self.client = RequestClient(context, endpoint, timeout_s=3600.0)
        self.pad_id = pad_id
        self.stop = stop
        self.abandoned = False
        """A batch request is out that this learner stopped waiting for."""

    def next_batch(
        self, policy_version: int, stop: Callable[[], bool] = lambda: False
    ) -> tuple[TrainBatch, dict[str, float]] | None:
        """The next batch, or None once ``stop()`` is true and no batch has come.

        An abandoned request stays open at the buffer: :meth:`save_state` cancels
        it, or hands its batch back if the buffer answered it after all.
        """
        if stop():
            return None
        receive = partial(self.client.request, BatchRequest(policy_version))
        waited_s = 0.0
        while True:
            try:
                reply, arrays = receive(timeout_s=STOP_POLL_S)
                break
            except TimeoutError:
                receive = self.client.receive  # the request is out: wait for its answer
                waited_s += STOP_POLL_S
                if stop():
                    self.abandoned = True
                    return None
                if waited_s >= self.client.timeout_s:
                    raise
        if not isinstance(reply, Trajectories):
            raise RuntimeError(f"buffer answered a batch request with {reply!r}")
        return collate(reply.samples, arrays, self.pad_id), reply.stats

    def start_eval(self, number: int, policy_version: int) -> bool:
        """Start eval round ``number`` of ``policy_version``; False if the buffer did not
        (an earlier round is still running: skipped and counted there)."""
        request = StartEval(round=number, policy_version=policy_version)
        self.client.send(request)
        reply, _ = self.reply_within(START_EVAL_TIMEOUT_S)
        if not isinstance(reply, Ack):
            raise RuntimeError(f"buffer answered {request!r} with {reply!r}")
        return bool(reply.accepted)

    def eval_results(self, wait_s: float, stop: Callable[[], bool]) -> EvalResults | None:
        """Eval results no batch carried; the buffer holds the request up to ``wait_s``
        while a round runs. None once ``stop()`` is true first (the learner is exiting)."""
        self.client.send(EvalResultsRequest(wait_s=wait_s))
        waited_s = 0.0
        while True:
            try:
                reply, _ = self.client.receive(timeout_s=STOP_POLL_S)
                break
            except TimeoutError:
                waited_s += STOP_POLL_S
                if stop():
                    return None
                if waited_s >= wait_s + START_EVAL_TIMEOUT_S:
                    raise
        if not isinstance(reply, EvalResults):
            raise RuntimeError(f"buffer answered a request for eval results with {reply!r}")
        return reply

    def save_state(self, step: int, timeout_s: float | None = None) -> None:
        """Have the buffer write its part of checkpoint ``step``; BufferStateNotSaved if
        it refuses or does not answer within ``timeout_s`` (default: the client's)."""
        request = SaveBufferState(step, abandoned_batch_request=self.abandoned)
        limit_s = self.client.timeout_s if timeout_s is None else timeout_s
        try:
            self.client.send(request)
            reply, _ = self.reply_within(limit_s)
            if self.abandoned and isinstance(reply, Trajectories):
                # the abandoned request's answer, sent before the buffer read this one,
                # which handed that batch back: untrained, it stays in the saved state
                reply, _ = self.reply_within(limit_s)
        except (TimeoutError, WireError, zmq.ZMQError) as error:
            raise BufferStateNotSaved(f"the buffer did not save its part ({error})") from error
        self.abandoned = False
        if not isinstance(reply, Ack):
            raise BufferStateNotSaved(f"the buffer refused to save its part: {reply!r}")

    def reply_within(self, timeout_s: float):
        """The answer to the request out, within ``timeout_s``, or within
        ``FINAL_SAVE_TIMEOUT_S`` of a stop, whichever ends first; TimeoutError if none."""
        deadline = time.monotonic() + timeout_s
        stopping = False
        while True:
            if not stopping and self.stop():
                stopping = True
                deadline = min(deadline, time.monotonic() + FINAL_SAVE_TIMEOUT_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                cut = f", cut to {FINAL_SAVE_TIMEOUT_S:g}s by a stop" if stopping else ""
                raise TimeoutError(
                    f"no reply from {self.client.endpoint} within {timeout_s:g}s{cut}"
                )
            try:
                return self.client.receive(timeout_s=min(STOP_POLL_S, remaining))
            except TimeoutError:
                continue


def lr_multiplier(config: Config):
    """The schedule as a function of the step: linear warm-up, then constant or a decay."""
    learner, total = config.learner, config.run.total_steps

    def multiplier(step: int) -> float:
        if step < learner.warmup_steps:
            return (step + 1) / learner.warmup_steps
        if learner.lr_schedule == "constant":
            return 1.0
        progress = (step - learner.warmup_steps) / max(1, total - learner.warmup_steps)
        progress = min(progress, 1.0)
        decay = (
            1 - progress
            if learner.lr_schedule == "linear"
            else 0.5 * (1 + math.cos(math.pi * progress))
        )
        return learner.min_lr_ratio + (1 - learner.min_lr_ratio) * decay

    return multiplier


class Learner:
    """Sharded model, optimizer, schedule and update rule, without sockets (tests drive it)."""

    def __init__(self, config: Config, ranks: Ranks):
        self.config = config
        self.ranks = ranks
        algorithm = config.algorithm
        policy, self.tokenizer = build_policy(config.model, config.run.seed)
        self.policy_config = policy.config
        model: nn.Module = policy
        if algorithm.advantage == "gae":
            with torch.random.fork_rng():
                model = sharding.PolicyWithValueHead(policy)
        self.model = sharding.shard(model, config.learner, ranks)
        self.publish_prefix = "policy." if algorithm.advantage == "gae" else ""
        self.reference = None
        if algorithm.kl_coef > 0:
            reference, _ = build_policy(config.model, config.run.seed)
            reference.requires_grad_(False)
            self.reference = sharding.shard(reference, config.learner, ranks)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=config.learner.lr, weight_decay=config.learner.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(config))
        self.update = Update(self.model, self.optimizer, config, ranks, self.reference)
        self.step = 0
        """Steps done; also the policy version."""
        self.checkpoints_refused = 0
        """Checkpoints not written because the weights or optimizer state were not finite."""

    @property
    def version(self) -> int:
        return self.step

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        self.model.train()
        metrics = self.update(batch, self.version)
        metrics["learner_lr"] = self.scheduler.get_last_lr()[0]
        metrics["learner_checkpoints_refused_total"] = float(self.checkpoints_refused)
        self.scheduler.step()
        self.step += 1
        return metrics

    def full_tensors(self):
        """The policy's full tensors, one at a time (a collective: every rank drains it)."""
        return sharding.full_tensors(self.model, self.publish_prefix)

    def save_checkpoint(self, path: Path) -> bool:
        """Write this rank's part; False (on every rank) if refused as not finite."""
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "skipped_nonfinite_total": self.update.skipped_nonfinite,
        }
        saved = checkpoint.save(path, self.model, self.optimizer, state, self.ranks.rank)
        if not saved:
            self.checkpoints_refused += 1
        return saved

    def load_checkpoint(self, path: Path) -> None:
        state = checkpoint.load(path, self.model, self.optimizer, self.ranks.rank)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.update.skipped_nonfinite = state.get("skipped_nonfinite_total", 0)

    def save_pretrained(self, path: Path) -> None:
        """The policy in Hugging Face format (rank 0 writes; every rank must call)."""
        state = dict(self.full_tensors())
        if self.ranks.is_main:
            policy = empty_like(self.policy_config, DTYPES[self.config.model.dtype])
            policy.load_state_dict(state)
            try:
                policy.save_pretrained(path)
                self.tokenizer.save_pretrained(path)
            except OSError as error:
                raise checkpoint.CheckpointWriteError(path, error, "the final policy") from error


class StopRequest:
    """Set by SIGTERM or SIGINT; the training loop stops at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._request)

    def _request(self, *_) -> None:
        self.requested = True

    def __call__(self) -> bool:
        return self.requested


def stop_agreed(stop: bool, ranks: Ranks) -> bool:
    """Rank 0's ``stop`` on every rank; the others wait for it here, never mid-collective."""
    if ranks.world_size == 1:
        return stop
    flag = torch.tensor([int(stop)], device=ranks.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def run(config: Config, run_dir: Path, resume_from: Path | None = None) -> None:
    """Train to ``run.total_steps`` or a stop; a file that cannot be written ends it in one
    line (logged first: on a full disk a long traceback may not fit in the log)."""
    try:
        _train(config, run_dir, resume_from)
    except (RecordWriteError, checkpoint.CheckpointWriteError) as error:
        log.error("%s", error)
        raise error.with_traceback(None) from None  # the line says it all


def _train(config: Config, run_dir: Path, resume_from: Path | None) -> None:
    stop = StopRequest()  # first: a signal during start-up stops before step 1
    ranks = distributed.init(config.learner.device)
    torch.set_num_threads(config.learner.num_threads)
    torch.manual_seed(config.run.seed)
    learner = Learner(config, ranks)
    log.info(
        "rank %d of %d on %s: %.1fM parameters, sharded with FSDP2",
        ranks.rank,
        ranks.world_size,
        ranks.device,
        sum(p.numel() for p in learner.model.parameters()) / 1e6,
    )
    if resume_from is not None:
        learner.load_checkpoint(resume_from)
        log.info("resumed from %s at version %d", resume_from, learner.version)
    with ExitStack() as cleanup:
        cleanup.callback(distributed.shutdown)
        main = _MainRank(config, run_dir, learner, cleanup, stop) if ranks.is_main else None
        publish(learner, main)
        published = learner.version
        if main and (eval_due(config, learner.version) or before_training(config, learner)):
            main.start_eval(learner.version)
        checkpointed = learner.step
        while learner.step < config.run.total_steps:
            progress.beat(
                f"waiting for a batch for step {learner.step + 1}", waiting_for="generators"
            )
            waited = time.perf_counter()
            fetched = main.buffer.next_batch(learner.version, stop) if main else None
            if stop_agreed(fetched is None, ranks):
                break
            batch, buffer_stats = fetched or (None, {})
            batch = distributed.broadcast_batch(batch, ranks)
            wait_s = time.perf_counter() - waited

            progress.beat(f"training step {learner.step + 1}")
            started = time.perf_counter()
            consumed_version = learner.version
            metrics = learner.train_step(batch)
            update_s = time.perf_counter() - started

            stall = 0.0
            if learner.version % config.learner.sync_interval == 0:
                stall = publish(learner, main)
                published = learner.version
                if main and eval_due(config, learner.version):
                    main.start_eval(learner.version)
            if main:
                metrics |= buffer_stats | main.publisher.stats()  # weights_* counters
                main.log(batch, consumed_version, metrics, wait_s, update_s, stall)
            if (
                config.learner.checkpoint_every
                and learner.step % config.learner.checkpoint_every == 0
            ):
                save_checkpoint(learner, main, run_dir)
                checkpointed = learner.step
        if learner.step < config.run.total_steps:  # asked to stop
            if learner.step > checkpointed:
                save_checkpoint(learner, main, run_dir, buffer_timeout_s=FINAL_SAVE_TIMEOUT_S)
            distributed.barrier(ranks)
            log.info("stopped by a signal after step %d", learner.step)
            return
        final_eval = None
        if config.eval.enabled and config.eval.at_end:
            if published != learner.version:  # the generators evaluate published weights
                publish(learner, main)
            if main is not None:
                final_eval = main.final_eval(run_dir / "final", stop)
                final_eval.begin()  # the final round runs while the policy is saved
        if main is not None:
            (run_dir / "final" / FINAL_EVAL).unlink(missing_ok=True)  # an earlier launch's
            log.info("trained %d steps; saving the final policy", learner.step)
        progress.beat("saving the final policy")
        learner.save_pretrained(run_dir / "final")
        distributed.barrier(ranks)  # every rank is done with the others before any exits
        if final_eval is not None:
            progress.beat("waiting for the final eval", patience_s=config.eval.final_timeout_s + 60)
            final_eval.finish()


def eval_due(config: Config, version: int) -> bool:
    """An eval round starts once ``version`` is published: every ``eval.every_steps``
    versions, not at 0 (see ``eval.before_training``) nor at the last, whose round no
    batch would report (``eval.at_end`` evaluates it apart)."""
    every = config.eval.every_steps
    return bool(every) and 0 < version < config.run.total_steps and version % every == 0


def before_training(config: Config, learner: Learner) -> bool:
    """A round of the initial policy, when ``eval.before_training`` asks for one."""
    return config.eval.enabled and config.eval.before_training and learner.version == 0


def publish(learner: Learner, main: _MainRank | None) -> float:
    """Hand the current weights to the generators; returns the seconds training stalled."""
    progress.beat(f"publishing weights v{learner.version}")
    started = time.perf_counter()
    tensors = learner.full_tensors()
    if main is None:
        for _ in tensors:  # take part in the gathers; rank 0 keeps the tensors
            pass
    else:
        # streamed: one parameter gathered, copied and released at a time
        main.publisher.publish(tensors, learner.version)
    return time.perf_counter() - started


def save_checkpoint(
    learner: Learner,
    main: _MainRank | None,
    run_dir: Path,
    buffer_timeout_s: float | None = None,
) -> None:
    progress.beat(f"checkpointing step {learner.step}")
    path = checkpoint_dir(run_dir, learner.step)
    if not learner.save_checkpoint(path):
        return  # not finite: refused and logged; no buffer state, never COMPLETE
    if main is None:
        return
    try:
        main.buffer.save_state(learner.step, buffer_timeout_s)
    except BufferStateNotSaved as error:
        # the learner's state is intact: complete the checkpoint without the buffer
        if not checkpoint.complete_without_buffer(run_dir, path, learner.step, str(error)):
            return
    checkpoint.mark_complete(path)
    log.info("checkpoint %s", path)
    checkpoint.prune(run_dir, learner.config.learner.keep_checkpoints, path)


class _MainRank:
    """What only rank 0 does: talk to the buffer and the generators, and log."""

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        learner: Learner,
        cleanup: ExitStack,
        stop: Callable[[], bool] = lambda: False,
    ):
        self.config = config
        self.tokenizer = learner.tokenizer
        self.context = client_context(config.cluster, LEARNER)
        cleanup.callback(self.context.destroy, linger=0)
        self.publisher = WeightPublisher(
            tcp(config.cluster.bind_address, config.cluster.weights_port),
            cluster=config.cluster,
        )
        cleanup.callback(self.publisher.close)
        self.buffer = BufferClient(
            self.context,
            tcp(config.cluster.host, config.cluster.buffer_port),
            learner.tokenizer.pad_token_id,
            stop,
        )
        self.tracker = Tracker(
            run_dir, config.run.name, config.model_dump(mode="json"), config.tracking.aim
        )
        cleanup.push(lambda failed, *_: self.tracker.close(hurry=failed is not None))
        self.trained_groups = JsonLines(run_dir / TRAINED_GROUPS)
        cleanup.callback(self.trained_groups.close)
        self.samples_total = 0
        self.wait_total = 0.0
        self.eval_every = config.eval.every_steps
        self.started = time.perf_counter()
        self.first_step = learner.step
        self.eval_only_step = config.run.total_steps
        """The step of the next line logged after training (eval results only)."""

    def start_eval(self, version: int) -> None:
        """Ask the buffer to evaluate ``version`` (round ``version // eval.every_steps``)."""
        number = version // self.eval_every
        try:
            started = self.buffer.start_eval(number, version)
        except TimeoutError as error:
            if not self.buffer.stop():
                raise
            log.warning("eval round %d (version %d) not started: %s", number, version, error)
            return  # stopping: the final checkpoint comes next, buffer or not
        if started:
            log.info("eval round %d started for version %d", number, version)
        else:
            log.warning(
                "eval round %d (version %d) skipped: the previous round is still running; "
                "raise eval.every_steps or lower eval.max_prompts",
                number,
                version,
            )

    def final_eval(self, final_dir: Path, stop: Callable[[], bool]) -> FinalEval:
        return FinalEval(self.config, final_dir, self.buffer, self.log_eval, stop)

    def log_eval(self, results: dict[str, float], final: bool) -> dict:
        """A round's results that came after training, as a line of their own (``eval_only``;
        ``eval_final`` for the final policy's), numbered on from the last step; returns it."""
        self.log_round(results)
        record: dict = {"version": self.config.run.total_steps, "eval_only": True}
        if final:
            record["eval_final"] = True
        record |= results
        record["time_s"] = time.perf_counter() - self.started
        step = self.eval_only_step
        self.eval_only_step += 1
        self.tracker.log(step, record)
        return {"step": step, **record}

    def log_round(self, metrics: dict[str, float]) -> None:
        log.info(
            "eval round %d (version %d): reward %.3f over %d samples",
            metrics["eval_round"],
            metrics["eval_policy_version"],
            metrics["eval_reward_mean"],
            metrics["eval_samples"],
        )

    def generations(self, batch: TrainBatch) -> list[dict[str, object]]:
        """The first samples of the first groups of ``batch``, decoded, for aim."""
        wanted = self.config.tracking.generations_per_step
        if not wanted or not self.config.tracking.aim:
            return []
        rows = []
        for row in range(min(wanted, batch.num_samples)):
            length = int(batch.attention_mask[row].sum())
            split = length - int(batch.response_lengths[row])
            ids = batch.input_ids[row]
            rows.append(
                {
                    "group": int(batch.group_ids[row]),
                    "reward": round(float(batch.rewards[row]), 4),
                    "prompt": self.tokenizer.decode(ids[:split], skip_special_tokens=True),
                    "response": self.tokenizer.decode(ids[split:length], skip_special_tokens=True),
                }
            )
        return rows

    def log(
        self,
        batch: TrainBatch,
        version: int,
        metrics: dict[str, float],
        wait_s: float,
        update_s: float,
        stall_s: float,
    ) -> None:
        self.samples_total += batch.num_samples
        self.wait_total += wait_s
        elapsed = time.perf_counter() - self.started
        made = batch.versions != torch.iinfo(batch.versions.dtype).max  # any model token?
        staleness = (version - batch.versions[made]).float() if made.any() else torch.zeros(1)
        tokens = int(batch.attention_mask.sum())
        groups = sorted(set(batch.group_ids.tolist()))
        self.trained_groups.write({"step": version, "version": version + 1, "group_ids": groups})
        if "eval_reward_mean" in metrics:
            self.log_round(metrics)
        self.tracker.log_generations(version, self.generations(batch))
        self.tracker.log(
            version,
            {
                "version": version + 1,
                "reward_mean": batch.rewards.mean().item(),
                "staleness_mean": staleness.mean().item(),
                "staleness_max": staleness.max().item(),
                "samples_total": self.samples_total,
                "samples_per_s": self.samples_total / elapsed,
                "response_len_mean": batch.response_lengths.float().mean().item(),
                "learner_tokens_per_s": tokens / update_s if update_s > 0 else 0.0,
                "learner_wait_s": wait_s,
                "learner_wait_frac": self.wait_total / elapsed,
                "time_update_s": update_s,
                "time_publish_stall_s": stall_s,
                "time_s": elapsed,
                **metrics,
            },
        )
