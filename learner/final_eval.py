"""The final policy's held-out eval (``eval.at_end``): rank 0, after the last step.

During training a round's results ride along with a later batch; after the last
step no batch comes, so rank 0 asks the buffer for them (``EvalResultsRequest``,
held there until a round completes)::

    last step ─▶ publish version T ─▶ begin(): results waiting? a round running?
                                       └─ none running: StartEval(final round, T)
             ─▶ save final/         ─▶ finish(): ask until the final round's results are in
                                       ├─ a round still running at the end: logged when done,
                                       │  then the final round starts
                                       └─ the final round: metrics.jsonl (eval_final) and
                                          final/eval.json

The final round is numbered ``ceil(run.total_steps / eval.every_steps)``, one past
the last round during training. Everything after the last step, saving
included, is bounded by ``eval.final_timeout_s``; a stop signal ends the wait
within ``STOP_POLL_S``. Either way the final eval is skipped, the learner's log
says why, and so does ``final/eval.json`` (``{"eval_final": true, "skipped": ...}``).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import zmq

from asyncrl.config import Config
from asyncrl.core.messages import NOT_EVAL, EvalResults
from asyncrl.core.paths import FINAL_EVAL

log = logging.getLogger("asyncrl.learner")

RESULTS_WAIT_S = 30.0
"""The longest one request for results asks the buffer to hold it (it is asked again)."""


class EvalBuffer(Protocol):
    """What the final eval needs of rank 0's line to the buffer (``BufferClient``)."""

    def start_eval(self, number: int, policy_version: int) -> bool: ...

    def eval_results(self, wait_s: float, stop: Callable[[], bool]) -> EvalResults | None: ...


def final_round(config: Config) -> int:
    """The final round's number: one past every round started during training."""
    return -(-config.run.total_steps // config.eval.every_steps)


class FinalEval:
    """Starts the final round, collects what no batch carried, and reports the result.

    ``log_eval(results, final)`` writes a round's results as a metrics.jsonl line and
    returns that line.
    """

    def __init__(
        self,
        config: Config,
        final_dir: Path,
        buffer: EvalBuffer,
        log_eval: Callable[[dict[str, float], bool], dict],
        stop: Callable[[], bool],
    ):
        self.version = config.run.total_steps
        self.number = final_round(config)
        self.timeout_s = config.eval.final_timeout_s
        self.deadline = time.monotonic() + self.timeout_s
        self.path = final_dir / FINAL_EVAL
        self.buffer = buffer
        self.log_eval = log_eval
        self.stop = stop
        self.running = NOT_EVAL
        """The round running at the buffer, as of its last answer."""
        self.started = False
        self.record: dict | None = None
        """The final round's metrics.jsonl line, once its results are in."""
        self.skipped: str | None = None

    def begin(self) -> None:
        """Log the results waiting at the buffer; start the final round unless one runs."""
        try:
            self._collect(0.0)
            self._start_if_idle()
        except (TimeoutError, RuntimeError, zmq.ZMQError) as error:
            self.skipped = f"the buffer did not answer: {error}"

    def finish(self) -> dict | None:
        """Wait (bounded, stoppable) for the final round; write ``final/eval.json``.

        Returns the final round's line, or None when it was skipped (logged, and
        written to the file as ``skipped``)."""
        while self.record is None and self.skipped is None:
            remaining = self.deadline - time.monotonic()
            if self.stop():
                self.skipped = "stopped by a signal"
            elif remaining <= 0:
                self.skipped = f"no result within eval.final_timeout_s={self.timeout_s:g}"
            elif self.running == NOT_EVAL:  # and no results: none will come
                self.skipped = f"the buffer neither runs round {self.number} nor has its results"
            else:
                try:
                    self._collect(min(remaining, RESULTS_WAIT_S))
                    self._start_if_idle()
                except (TimeoutError, RuntimeError, zmq.ZMQError) as error:
                    self.skipped = f"the buffer did not answer: {error}"
        if self.record is None:
            log.warning("final eval of version %d skipped: %s", self.version, self.skipped)
            self._write({"eval_final": True, "skipped": self.skipped})
            return None
        self._write(self.record)
        log.info(
            "final eval (version %d): reward %.3f over %d samples; %s",
            self.version,
            self.record["eval_reward_mean"],
            self.record["eval_samples"],
            self.path,
        )
        return self.record

    def _collect(self, wait_s: float) -> None:
        """Log every round's results the buffer has (waiting up to ``wait_s`` while a round
        runs); a stop while waiting leaves the state as it was."""
        reply = self.buffer.eval_results(wait_s, self.stop)
        if reply is None:
            return
        for results in reply.results:
            final = round(results.get("eval_round", NOT_EVAL)) == self.number
            line = self.log_eval(results, final)
            if final:
                self.record = line
        self.running = reply.running_round

    def _start_if_idle(self) -> None:
        """Start the final round once no other round runs (rounds never overlap)."""
        if self.started or self.record is not None or self.running != NOT_EVAL:
            return
        self.started = True
        if self.buffer.start_eval(self.number, self.version):
            self.running = self.number
            log.info("final eval: round %d of version %d started", self.number, self.version)
        else:
            log.warning("the buffer did not start round %d: it ran already", self.number)

    def _write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(_strict(record), indent=1) + "\n")


def _strict(record: dict) -> dict:
    """NaN (nothing to measure) as ``null``, as in metrics.jsonl."""
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in record.items()
    }
