"""Held-out evaluation (``eval:``), started by rank 0; it never stops the loop.

Right after publishing version ``V`` with ``V % eval.every_steps == 0`` (and
at ``V = 0`` with ``eval.before_training``, and at the version a resumed run
starts from when one is due there), rank 0 tells the buffer to start round
``V // eval.every_steps`` (:class:`~asyncrl.core.messages.StartEval`). The
generators do the work; the round's ``eval_*`` results arrive with a later
batch's buffer stats and are logged at that step (:mod:`.step_log`). No batch
comes after the last step, so with ``eval.at_end`` the final policy is
evaluated apart (:mod:`.final_eval`): rank 0 starts its round once training is
done, waits for it (and for a round still running) up to
``eval.final_timeout_s``, and logs it as one more line, after saving the final
policy so that the wait never holds the other ranks.

Every rank holds an evaluator; every rank but 0, and rank 0 when ``eval`` is
off, holds :class:`NoEval`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from asyncrl.config import Config
from asyncrl.core import progress
from asyncrl.learner.buffer_client import BufferClient
from asyncrl.learner.final_eval import FinalEval

log = logging.getLogger("asyncrl.learner")


def eval_due(config: Config, version: int) -> bool:
    """An eval round starts once ``version`` is published: every ``eval.every_steps``
    versions, not at 0 (see ``eval.before_training``) nor at the last, whose round no
    batch would report (``eval.at_end`` evaluates it apart)."""
    every = config.eval.every_steps
    return bool(every) and 0 < version < config.run.total_steps and version % every == 0


def before_training(config: Config, version: int) -> bool:
    """A round of the initial policy, when ``eval.before_training`` asks for one."""
    return config.eval.enabled and config.eval.before_training and version == 0


class Evaluator:
    """Rank 0's held-out eval: starts the rounds that are due, and the final policy's.

    ``log_eval(results, final)`` writes results that came after training as a
    metrics.jsonl line of their own and returns it (:meth:`.StepLog.log_eval`).
    """

    def __init__(
        self,
        config: Config,
        buffer: BufferClient,
        log_eval: Callable[[dict[str, float], bool], dict],
        stop: Callable[[], bool],
    ):
        self.config = config
        self.buffer = buffer
        self.log_eval = log_eval
        self.stop = stop
        self.final: FinalEval | None = None
        """The final policy's eval, once training is done (``eval.at_end``)."""

    def begin(self, version: int) -> None:
        """Before the first step, its weights just published: a round if one is due."""
        if eval_due(self.config, version) or before_training(self.config, version):
            self.start(version)

    def after_step(self, version: int) -> None:
        """After the step that made ``version`` (published: ``eval.every_steps`` is a
        multiple of ``learner.sync_interval``): a round if one is due."""
        if eval_due(self.config, version):
            self.start(version)

    def start(self, version: int) -> None:
        """Ask the buffer to evaluate ``version`` (round ``version // eval.every_steps``)."""
        number = version // self.config.eval.every_steps
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

    def begin_final(self, final_dir: Path) -> None:
        """With ``eval.at_end``, once the final version is published: start its round, which
        runs while the final policy is saved."""
        if not self.config.eval.at_end:
            return
        self.final = FinalEval(self.config, final_dir, self.buffer, self.log_eval, self.stop)
        self.final.begin()

    def finish_final(self) -> None:
        """Wait for the final round (bounded by ``eval.final_timeout_s``) and report it."""
        if self.final is None:
            return
        progress.beat(
            "waiting for the final eval", patience_s=self.config.eval.final_timeout_s + 60
        )
        self.final.finish()


class NoEval:
    """The evaluator of every rank but 0, and of rank 0 when ``eval`` is off."""

    def begin(self, version: int) -> None:
        pass

    def after_step(self, version: int) -> None:
        pass

    def begin_final(self, final_dir: Path) -> None:
        pass

    def finish_final(self) -> None:
        pass
