"""The messages between the learner and the buffer.

The learner asks for batches (:class:`BatchRequest`, answered with
:class:`~asyncrl.core.generator_messages.Trajectories`), starts held-out eval rounds
(:class:`StartEval`) and collects their last results (:class:`EvalResultsRequest`,
answered with :class:`EvalResults`), has the buffer checkpoint its state
(:class:`SaveBufferState`) and announces LoRA adapters (:class:`AdapterPublished`).
They live apart from the generators' (:mod:`asyncrl.core.generator_messages`) so each
side's messages read on their own; :mod:`asyncrl.core.messages` re-exports all of them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from asyncrl.core.generator_messages import NOT_EVAL, AdapterDigest, EvalRound
from asyncrl.core.wire import _Body

# --------------------------------------------------------------------------
# learner <-> buffer


class AdapterPublished(_Body, tag="adapter_published"):
    """The learner is about to publish ``version``, whose LoRA adapter has ``digest``: sent
    before any replica can fetch it, answered with ``Ack(accepted=1)``. The buffer refuses
    samples whose replica reports another digest for the version."""

    version: Annotated[int, msgspec.Meta(ge=0)]
    digest: AdapterDigest


class BatchRequest(_Body, tag="batch_request"):
    """The learner at ``policy_version`` asks for its next batch (answered when ready)."""

    policy_version: int


class StartEval(_Body, tag="start_eval"):
    """The learner published ``policy_version``: evaluate it on the held-out prompts.

    ``StartEval(round=3, policy_version=30)``. The buffer hands the round's prompts out
    before new training prompts, and its results ride along with a later batch's
    ``stats`` (``eval_*``) or answer an :class:`EvalResultsRequest`. Answered with
    ``Ack(accepted=1)``, or ``Ack(accepted=0)`` when the round is not started: an
    earlier round is still running (counted as skipped), or this round was started
    already.
    """

    round: Annotated[int, msgspec.Meta(ge=0)]
    policy_version: Annotated[int, msgspec.Meta(ge=0)]


MAX_EVAL_WAIT_S = 3600.0
"""The longest an EvalResultsRequest may ask the buffer to hold it."""


class EvalResultsRequest(_Body, tag="eval_results_request"):
    """The learner, done training, asks for the eval results no batch will carry.

    ``EvalResultsRequest(wait_s=30.0)``. Answered with :class:`EvalResults`: every
    finished round's results not handed over yet (each is handed over once, with a
    batch or here). With none waiting while a round runs, the buffer holds the request
    up to ``wait_s`` seconds and answers the moment that round completes; with no round
    running it answers at once, so ``running_round == -1`` says no more results will
    come. A ``wait_s`` that is negative, not finite or above ``MAX_EVAL_WAIT_S`` is
    rejected (``bad_header``).
    """

    wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=MAX_EVAL_WAIT_S)] = 0.0


class EvalResults(_Body, tag="eval_results"):
    results: list[dict[str, float]]
    """Finished rounds' ``eval_*`` results, oldest first; empty if none finished since."""
    running_round: EvalRound = NOT_EVAL
    """The round still running (its results come later), or -1: none is."""


class SaveBufferState(_Body, tag="save_buffer_state"):
    """The learner checkpoints step ``step``: the buffer writes its dataset cursor and
    unfinished groups into that checkpoint's directory, then answers with an Ack.

    The buffer derives the path from its own run directory; a peer never names a file.
    ``abandoned_batch_request``: the learner stopped waiting for its last BatchRequest
    (it is stopping), so that request is cancelled or, if the buffer answered it
    already, the batch it served goes back among the groups not yet trained on.
    """

    step: int
    abandoned_batch_request: bool = False
