"""One learner step on one batch, on every rank: the policy-gradient update itself.

::

    pre-pass    no-grad forward where needed (:meth:`Update.proximal_logprobs`): proximal
                log-probs (several updates per batch, or KL in the reward), reference
                log-probs (KL), values (PPO critic); they stay on the learner's device
    plan        split into mini-batches (one per optimizer update), deal each to ranks
                and token-bounded micro-batches (the same plan on every rank)
    targets     on the whole batch (:mod:`.targets`): corrections, KL in the reward,
                advantages (group baselines need whole groups)
    micro-steps per mini-batch: forward/backward each micro-batch through the
                :class:`~.objective.Objective`, accumulating the gradients
    optimizer   clip, step (or skip a non-finite update)

Losses are normalised by counts over the whole mini-batch on all ranks (see
:func:`~asyncrl.learner.algorithms.aggregate`), so the sum over micro-batches
and ranks is the loss of the full mini-batch whatever the split; FSDP averages
gradients over ranks, which each rank's loss undoes by a factor ``world_size``.

An update whose loss or total gradient norm is not finite (a NaN or infinite
reward or advantage in the batch, say) is not applied: its gradients are
dropped, the optimizer does not step, and ``learner_skipped_nonfinite_total``
counts it. Every rank decides alike (the loss is summed over ranks, the norm
is the global one), so the shards stay in step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.config import Config
from asyncrl.core.reductions import Reduction, Stat
from asyncrl.learner import microbatch
from asyncrl.learner.algorithms import AGGREGATIONS, make_kl_controller, needs_of
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.objective import Normalizers, Objective, Tokens
from asyncrl.learner.packing import Layout, TokenOutputs, token_outputs
from asyncrl.learner.reference import Reference
from asyncrl.learner.targets import Targets, batch_targets

SKIP_WARNING_EVERY_S = 60.0
"""At most one warning per this many seconds about skipped non-finite updates."""

log = logging.getLogger("asyncrl.learner")


@dataclass(frozen=True)
class StepPlan:
    """A step's split of the batch: sequence lengths, the mini-batch plans (the same on
    every rank), and this rank's part of them."""

    lengths: list[int]
    plans: list[microbatch.Plan]
    mine: list[list[list[int]]]
    """``mine[update][micro_batch]`` -> rows."""


class Update:
    """Computes and applies the policy-gradient update for one batch."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Config,
        ranks: Ranks,
        reference: Reference | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.algorithm = config.algorithm
        self.needs = needs_of(config.algorithm)
        """What the configured estimator and KL ask for: values, token rewards, a reference."""
        self.ranks = ranks
        self.reference = reference
        self.layout = Layout(model, config.learner.pack_sequences, ranks.device, ranks.world_size)
        """How each micro-batch meets the model: packed with shared prompts, or padded."""
        self.temperature = config.generators.temperature
        algorithm = config.algorithm
        self.objective = Objective(algorithm)
        """The loss of a micro-batch, term by term, as the algorithm section configures it."""
        self.kl_control = make_kl_controller(
            algorithm.kl_controller,
            kl_coef=algorithm.kl_coef,
            target=algorithm.kl_target,
            horizon=algorithm.kl_horizon,
        )
        """The in-reward KL coefficient: fixed, or steered towards ``kl_target``."""
        self.positions = 0
        """Positions the model ran on in this step's updates, padding included: below the
        batch's tokens where samples share a prompt (:mod:`.packing`)."""
        self.skipped_nonfinite = 0
        """Optimizer updates not applied because the loss or gradient norm was not finite."""
        self._warned_at = -math.inf
        self._unwarned = 0

    def _plan(self, batch: TrainBatch) -> StepPlan:
        """The mini-batch plans (the same on every rank) and this rank's part of them."""
        learner = self.config.learner
        lengths = batch.attention_mask.sum(1).tolist()
        plans = microbatch.minibatch_plans(
            lengths,
            self.ranks.world_size,
            learner.max_tokens_per_microbatch,
            learner.minibatches,
        )
        mine = [plan[self.ranks.rank] for plan in plans]  # [update][micro_batch] -> rows
        return StepPlan(lengths, plans, mine)

    def proximal_logprobs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The pre-pass: what the update needs of the weights before this batch changes
        them, as full-batch [B, L-1] tensors (no grad) on the learner's device.
        ``proximal``, their log-probs, where the first update's own would not do (several
        updates per batch unless bypassed, KL in the reward, or a whole-batch correction);
        ``reference`` (KL) and ``values`` (PPO critic) from the same forward passes;
        ``{}`` when nothing is needed."""
        learner, algorithm = self.config.learner, self.algorithm
        plan = self._plan(batch)
        needs_proximal = (
            (learner.minibatches > 1 and not algorithm.bypass)
            or self.needs.kl_in_reward
            or algorithm.needs_proximal_pass
        )
        return self._pre_pass(
            batch, [m for update in plan.mine for m in update], plan.lengths, needs_proximal
        )

    def step(
        self, batch: TrainBatch, pre: dict[str, torch.Tensor], version: int
    ) -> dict[str, float]:
        """Train on ``batch`` (policy ``version``), given its :meth:`proximal_logprobs`."""
        plan = self._plan(batch)
        targets = batch_targets(self.algorithm, self.needs, self.kl_control, batch, pre)
        reduction = Reduction()
        self.positions = 0
        for number in range(len(plan.plans)):  # one optimizer update per mini-batch
            loss = self._micro_steps(targets, pre, plan, number, version, reduction)
            self._optimizer_step(loss, reduction, version, number, len(plan.plans))
        return self._metrics(reduction, targets, plan)

    def _micro_steps(
        self,
        targets: Targets,
        pre: dict[str, torch.Tensor],
        plan: StepPlan,
        number: int,
        version: int,
        reduction: Reduction,
    ) -> float:
        """Accumulate mini-batch ``number``'s gradients over this rank's micro-batches;
        returns this rank's share of the mini-batch's objective."""
        self.optimizer.zero_grad(set_to_none=True)
        normalizers = self._normalizers(targets.batch.loss_mask, plan.plans[number])
        parts = microbatch.micro_batches(plan.mine[number], plan.lengths)
        loss = 0.0
        for index, part in enumerate(parts):
            self.model.set_requires_gradient_sync(index == len(parts) - 1)
            stats, part_loss = self._micro_step(targets, pre, part, normalizers, version)
            loss += part_loss
            reduction.update(stats)
        return loss

    def _optimizer_step(
        self, loss: float, reduction: Reduction, version: int, number: int, count: int
    ) -> None:
        """Clip the gradients and step, unless the mini-batch's loss (summed over ranks) or
        the global gradient norm is not finite: then drop the gradients instead."""
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.config.learner.grad_clip
        )
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        norm = grad_norm.item()  # the global norm: the same on every rank
        reduction.add("learner_grad_norm", Stat.mean(norm, 1.0))
        loss = self._summed_over_ranks(loss)
        if math.isfinite(loss) and math.isfinite(norm):
            self.optimizer.step()
        else:  # a NaN or inf would reach the weights and the optimizer state
            self.optimizer.zero_grad(set_to_none=True)
            self._skip_nonfinite(version, number, count, loss, norm)

    def _metrics(self, reduction: Reduction, targets: Targets, plan: StepPlan) -> dict[str, float]:
        """The step's statistics over micro-batches and ranks, with the whole batch's."""
        mask = targets.batch.loss_mask.bool()
        return (
            self._reduce(reduction)
            | {
                "advantage_abs_mean": targets.advantages[mask].abs().mean().item()
                if mask.any()
                else 0.0,
                "learner_minibatches": float(len(plan.mine)),
                "learner_microbatches": float(sum(len(update) for update in plan.mine)),
                "learner_positions": self._summed_over_ranks(float(self.positions)),
                "learner_skipped_nonfinite_total": float(self.skipped_nonfinite),
            }
            | targets.metrics
        )

    def _normalizers(self, loss_mask: torch.Tensor, plan: microbatch.Plan) -> Normalizers:
        """The mini-batch's counts over every rank's rows, which each loss divides by."""
        everyone = torch.tensor([i for rank in plan for rows in rank for i in rows])
        return Normalizers(
            num_tokens=loss_mask[everyone].sum().item(),
            num_sequences=self._sequences(loss_mask[everyone]),
            norm_length=self.config.generators.max_new_tokens,
        )

    def _sequences(self, loss_mask: torch.Tensor) -> float:
        """The mini-batch's sequence count for the seq-mean aggregations: the rows with a
        valid token, as verl counts them (every row for the constant Dr. GRPO norm)."""
        if AGGREGATIONS[self.algorithm.aggregation].counts_empty_rows:
            return float(loss_mask.shape[0])
        return float(loss_mask.bool().any(-1).sum().item())

    def _summed_over_ranks(self, value: float) -> float:
        """``value`` summed over ranks (a NaN or inf on any rank makes the sum non-finite)."""
        if self.ranks.world_size == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=self.ranks.device)
        dist.all_reduce(total)
        return total.item()

    def _skip_nonfinite(
        self, version: int, minibatch: int, minibatches: int, loss: float, norm: float
    ) -> None:
        """Count an update not applied; warn (rank 0, at most every
        :data:`SKIP_WARNING_EVERY_S`) naming the step and what was not finite."""
        self.skipped_nonfinite += 1
        self._unwarned += 1
        now = time.monotonic()
        if not self.ranks.is_main or now - self._warned_at < SKIP_WARNING_EVERY_S:
            return
        what = " and ".join(
            name
            for name, value in (("loss", loss), ("gradient norm", norm))
            if not math.isfinite(value)
        )
        log.warning(
            "step %d (mini-batch %d of %d): %s not finite (loss %s, gradient norm %s): "
            "update skipped, gradients dropped; %d update(s) skipped so far, %d since the last "
            "such warning (learner_skipped_nonfinite_total)",
            version,
            minibatch + 1,
            minibatches,
            what,
            loss,
            norm,
            self.skipped_nonfinite,
            self._unwarned,
        )
        self._warned_at = now
        self._unwarned = 0

    # ---------------------------------------------------------------- passes

    @torch.no_grad()
    def _pre_pass(
        self,
        batch: TrainBatch,
        parts: list[list[int]],
        lengths: list[int],
        needs_proximal: bool,
    ) -> dict[str, torch.Tensor]:
        """Full-batch [B, L-1] tensors computed before any update: each rank fills its
        rows and a sum over ranks assembles them (rows never overlap)."""
        wanted = []
        if needs_proximal:
            wanted.append("proximal")
        if self.reference is not None:
            wanted.append("reference")
        if self.needs.values:
            wanted.append("values")
        if not wanted:
            return {}
        device = self.ranks.device
        out = {name: torch.zeros_like(batch.behavior_logprobs, device=device) for name in wanted}
        for part in microbatch.micro_batches(parts, lengths):
            inputs = self.layout.input(part, batch, device)
            cut = (part.rows, slice(0, part.width - 1))
            if "proximal" in out or "values" in out:
                policy = token_outputs(self.model, inputs, self.temperature, entropy="none")
                if "proximal" in out:
                    out["proximal"][cut] = policy.logprobs * part.weight
                if "values" in out:
                    out["values"][cut] = policy.values * part.weight
            if "reference" in out:
                reference = self.reference.logprobs(inputs, self.temperature)
                out["reference"][cut] = reference * part.weight
        if self.ranks.world_size > 1:
            for tensor in out.values():
                dist.all_reduce(tensor)
        return out  # stays on the device: the micro-steps read it there

    def _micro_step(
        self,
        targets: Targets,
        pre: dict[str, torch.Tensor],
        part: microbatch.MicroBatch,
        normalizers: Normalizers,
        version: int,
    ) -> tuple[dict[str, Stat], float]:
        """Forward and backward one micro-batch; returns its statistics, each with how it
        combines with the other micro-batches' and ranks', and the value of the objective
        that was back-propagated."""
        inputs = self.layout.input(part, targets.batch, self.ranks.device)
        self.positions += inputs.positions
        outputs = token_outputs(self.model, inputs, self.temperature, self.objective.entropy)
        tokens = self._tokens(part, targets, pre, outputs, version)
        evaluation = self.objective(tokens, normalizers, targets.weight_scale)
        (evaluation.loss * self.ranks.world_size).backward()
        return evaluation.stats(), evaluation.loss.item()

    def _tokens(
        self,
        part: microbatch.MicroBatch,
        targets: Targets,
        pre: dict[str, torch.Tensor],
        outputs: TokenOutputs,
        version: int,
    ) -> Tokens:
        """The micro-batch's rows of the batch, its targets and the pre-pass, on the device
        (the pre-pass's are there already), beside the model's outputs."""
        batch, device = targets.batch, self.ranks.device

        def cut(full: torch.Tensor | None) -> torch.Tensor | None:
            return None if full is None else part.tokens(full, device)

        return Tokens(
            logprobs=outputs.logprobs,
            entropy=outputs.entropy,
            values=outputs.values,
            behavior=part.tokens(batch.behavior_logprobs, device),
            proximal=cut(pre.get("proximal")),
            advantages=part.tokens(targets.advantages, device),
            mask=part.tokens(batch.loss_mask, device) * part.weight,
            current=part.tokens(batch.token_versions, device) == version,
            reference=cut(pre.get("reference")),
            old_values=cut(pre.get("values")) if outputs.values is not None else None,
            returns=cut(targets.returns),
        )

    def _reduce(self, reduction: Reduction) -> dict[str, float]:
        """The step's statistics over micro-batches and ranks, each as it declared.

        Every rank reports the same keys (the config decides them), so plain
        tensor reductions suffice. Losses are normalised by global counts, so
        their sum over micro-batches and ranks is the mini-batches' loss, shown
        per mini-batch.
        """
        _, summed, _, peaks = reduction.tables()
        table = torch.tensor(summed, dtype=torch.float64).to(self.ranks.device)
        maxima = torch.tensor(peaks, dtype=torch.float64).to(self.ranks.device)
        if self.ranks.world_size > 1:
            dist.all_reduce(table)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        out = reduction.from_tables(table.tolist(), maxima.tolist())
        for key in out:
            if key.startswith("loss_"):
                out[key] /= self.config.learner.minibatches
        return out
