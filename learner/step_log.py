"""The run's record, kept by rank 0: a ``metrics.jsonl`` line per step (and aim), the
groups each step trained (``trained_groups.jsonl``), and eval rounds in the log.

Every rank holds a step log; the others' is :class:`NoStepLog`, which keeps
nothing (rank 0's metrics are already reduced over every rank). A line that
cannot be written stops the learner (:class:`~asyncrl.core.tracking.RecordWriteError`);
aim failing only turns aim off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from asyncrl.config import Config
from asyncrl.core.paths import TRAINED_GROUPS
from asyncrl.core.tracking import JsonLines, Tracker
from asyncrl.core.trajectory import is_model_token, is_versioned
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.batch_source import Fetched
from asyncrl.learner.final_eval import FINAL_EVAL

log = logging.getLogger("asyncrl.learner")


def spanning_versions_frac(token_versions: torch.Tensor) -> float:
    """The share of samples whose model tokens come from more than one weight version:
    partial rollouts that an update reached mid-response or between an episode's turns.
    ``token_versions``: ``[B, L]``, environment tokens and padding below 0."""
    model = is_model_token(token_versions)
    if not token_versions.numel():
        return 0.0
    high = token_versions.masked_fill(~model, -1).amax(dim=1)
    low = token_versions.masked_fill(~model, torch.iinfo(token_versions.dtype).max).amin(dim=1)
    return ((high > low) & model.any(dim=1)).float().mean().item()


class StepLog:
    """Rank 0's record of the run; ``weights_stats`` adds the publisher's counters."""

    def __init__(
        self,
        config: Config,
        run_dir: Path,
        tokenizer,
        weights_stats: Callable[[], dict[str, float]],
        cleanup: ExitStack,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.weights_stats = weights_stats
        self.tracker = Tracker(
            run_dir, config.run.name, config.model_dump(mode="json"), config.tracking.aim
        )
        cleanup.push(lambda failed, *_: self.tracker.close(hurry=failed is not None))
        self.trained_groups = JsonLines(run_dir / TRAINED_GROUPS)
        cleanup.callback(self.trained_groups.close)
        self.samples_total = 0
        self.wait_total = 0.0
        self.started = time.perf_counter()
        self.eval_only_step = config.run.total_steps
        """The step of the next line logged after training (eval results only)."""

    def log(
        self,
        fetched: Fetched,
        version: int,
        metrics: dict[str, float],
        update_s: float,
        stall_s: float,
    ) -> None:
        """The line of the step that trained ``version`` on ``fetched``'s batch; its groups."""
        batch, wait_s = fetched.batch, fetched.wait_s
        metrics = metrics | fetched.buffer_stats | self.weights_stats()
        self.samples_total += batch.num_samples
        self.wait_total += wait_s
        elapsed = time.perf_counter() - self.started
        made = is_versioned(batch.versions)  # any model token?
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
                "samples_spanning_versions_frac": spanning_versions_frac(batch.token_versions),
                "learner_tokens_per_s": tokens / update_s if update_s > 0 else 0.0,
                "learner_wait_s": wait_s,
                "learner_wait_frac": self.wait_total / elapsed,
                "time_update_s": update_s,
                "time_publish_stall_s": stall_s,
                "time_s": elapsed,
                **metrics,
            },
        )

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

    def training_done(self, version: int, final_dir: Path) -> None:
        """Before the final policy is saved: a final eval result from an earlier launch says
        nothing about this one (this launch writes its own, or why there is none)."""
        (final_dir / FINAL_EVAL).unlink(missing_ok=True)
        log.info("trained %d steps; saving the final policy", version)


class NoStepLog:
    """The step log of every rank but 0: rank 0 keeps the record."""

    def log(
        self,
        fetched: Fetched,
        version: int,
        metrics: dict[str, float],
        update_s: float,
        stall_s: float,
    ) -> None:
        pass

    def log_eval(self, results: dict[str, float], final: bool) -> dict:
        return {}

    def training_done(self, version: int, final_dir: Path) -> None:
        pass
