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

The loop (:func:`_train_loop`) calls each part every step, on every rank, and
each decides for itself whether it has anything to do; rank 0's parts talk to
the buffer and the generators and keep the record, the others' only take part
in the collectives (:func:`_parts`)::

    part                      every rank                    rank 0 also
    batches (.batch_source)   agree to go on; get rank 0's  asks the buffer, waits
    publisher (.publisher)    gather full tensors           streams them to generators
    evaluator (.evaluator)    -                             starts eval rounds when due
    step_log (.step_log)      -                             metrics.jsonl, aim, groups
    checkpointer              write its shards when due     buffer's part, COMPLETE

SIGTERM (or SIGINT) stops the learner at a step boundary: rank 0 abandons a
batch it is still waiting for, or finishes the step it is training; every
rank then agrees to stop (:func:`.batch_source.stop_agreed`), the last complete
step is checkpointed with the buffer's state unless it already is, and the
process exits 0. Each step's group ids go to ``RUN_DIR/trained_groups.jsonl``,
so which prompts were trained can be checked across restarts, and so that a
checkpoint whose buffer part the buffer cannot write (it died: no answer
within ``FINAL_SAVE_TIMEOUT_S`` of a stop) is still completed, rank 0 writing
that part itself (:func:`.checkpoint.complete_without_buffer`). No wait for the
buffer outlasts a stop by more than ``FINAL_SAVE_TIMEOUT_S``
(:mod:`.buffer_client`).

A file of the run's record (``metrics.jsonl``, ``trained_groups.jsonl``) or a
checkpoint that cannot be written (a full disk) stops the learner at once with
one line naming the file and the error, and a non-zero status; aim failing only
turns aim off (:mod:`asyncrl.core.tracking`). Held-out evaluation never stops the
loop (:mod:`.evaluator`).
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from asyncrl.config import Config
from asyncrl.core import progress
from asyncrl.core.cores import torch_threads
from asyncrl.core.message_limits import total_replicas
from asyncrl.core.security import LEARNER, client_context
from asyncrl.core.stop_signals import ROLE_SIGNALS, StopSignals
from asyncrl.core.tracking import RecordWriteError
from asyncrl.core.transport import tcp
from asyncrl.learner import checkpoint, distributed
from asyncrl.learner.batch_source import BatchSource, from_rank_0
from asyncrl.learner.buffer_client import BufferClient
from asyncrl.learner.checkpointer import Checkpointer, Completer, NoCompleter
from asyncrl.learner.evaluator import Evaluator, NoEval
from asyncrl.learner.policy import Learner
from asyncrl.learner.publisher import Drain, Publisher
from asyncrl.learner.step_log import NoStepLog, StepLog
from asyncrl.weights import WeightPublisher
from asyncrl.weights.paths import learner_sink

log = logging.getLogger("asyncrl.learner")


def run(config: Config, run_dir: Path, resume_from: Path | None = None) -> None:
    """Train to ``run.total_steps`` or a stop; a file that cannot be written ends it in one
    line (logged first: on a full disk a long traceback may not fit in the log)."""
    try:
        _train(config, run_dir, resume_from)
    except (RecordWriteError, checkpoint.CheckpointWriteError) as error:
        log.error("%s", error)
        raise error.with_traceback(None) from None  # the line says it all


@dataclass
class Parts:
    """What the loop calls every step besides the policy; each decides whether to act."""

    batches: BatchSource
    publisher: Publisher
    evaluator: Evaluator | NoEval
    step_log: StepLog | NoStepLog
    checkpointer: Checkpointer


def _train(config: Config, run_dir: Path, resume_from: Path | None) -> None:
    stop = StopSignals(ROLE_SIGNALS).install()  # first: a signal in start-up stops before step 1
    ranks = distributed.init(config.learner.device)
    torch.set_num_threads(torch_threads(config.learner.num_threads))
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
        parts = _parts(config, run_dir, learner, stop, cleanup)
        parts.publisher.publish()
        parts.evaluator.begin(learner.version)
        _train_loop(learner, parts, config.run.total_steps)
        if learner.version < config.run.total_steps:  # asked to stop
            parts.checkpointer.on_stop()
            distributed.barrier(ranks)
            log.info("stopped by a signal after step %d", learner.version)
            return
        parts.publisher.finish()  # the final eval evaluates published weights
        parts.evaluator.begin_final(run_dir / "final")  # runs while the policy is saved
        parts.step_log.training_done(learner.version, run_dir / "final")
        parts.checkpointer.save_final_policy()
        distributed.barrier(ranks)  # every rank is done with the others before any exits
        parts.evaluator.finish_final()


def _train_loop(learner: Learner, parts: Parts, total_steps: int) -> None:
    """Train up to version ``total_steps``, or until every rank agreed to stop."""
    for version in range(learner.version, total_steps):
        fetched = parts.batches.next(version)
        if fetched is None:
            return
        progress.beat(f"training step {version + 1}")
        started = time.perf_counter()
        proximal = learner.proximal_logprobs(fetched.batch)
        metrics = learner.train_step(fetched.batch, proximal)
        update_s = time.perf_counter() - started
        stall_s = parts.publisher.after_step()
        parts.evaluator.after_step(learner.version)
        # logged first: a checkpoint completed without the buffer reads the step's groups
        parts.step_log.log(fetched, version, metrics, update_s, stall_s)
        parts.checkpointer.after_step()


def _parts(
    config: Config, run_dir: Path, learner: Learner, stop: StopSignals, cleanup: ExitStack
) -> Parts:
    """Rank 0's parts hold its sockets and files (closed by ``cleanup``); the other ranks'
    only take part in the collectives, rank 0 deciding for them."""
    if not learner.ranks.is_main:
        return Parts(
            batches=BatchSource(learner.ranks, from_rank_0),
            publisher=Publisher(learner, config, Drain()),
            evaluator=NoEval(),
            step_log=NoStepLog(),
            checkpointer=Checkpointer(learner, run_dir, NoCompleter()),
        )
    cluster = config.cluster
    context = client_context(cluster, LEARNER)
    cleanup.callback(context.destroy, linger=0)
    weights_endpoint = tcp(cluster.bind_address, cluster.weights_port)
    zmq = WeightPublisher(weights_endpoint, cluster=cluster, replicas=total_replicas(config))
    weights = learner_sink(config, run_dir, zmq)  # zmq alone, or shared memory feeding it
    cleanup.callback(weights.close)
    buffer = BufferClient(
        context,
        tcp(cluster.host, cluster.buffer_port),
        learner.tokenizer.pad_token_id,
        stop,
        device=learner.ranks.device,
    )
    step_log = StepLog(config, run_dir, learner.tokenizer, weights.stats, cleanup)
    evaluator = Evaluator(config, buffer, step_log.log_eval, stop)
    return Parts(
        batches=BatchSource(learner.ranks, partial(buffer.next_batch, stop=stop)),
        publisher=Publisher(
            learner,
            config,
            weights,
            announce=buffer.announce_adapter if learner.publishes_adapters else None,
        ),
        evaluator=evaluator if config.eval.enabled else NoEval(),
        step_log=step_log,
        checkpointer=Checkpointer(
            learner, run_dir, Completer(buffer, run_dir, config.learner.keep_checkpoints)
        ),
    )
