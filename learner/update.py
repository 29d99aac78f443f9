"""One learner step on one batch, on every rank: the policy-gradient update itself.

::

    plan        split into mini-batches (one per optimizer update), deal each to ranks
                and token-bounded micro-batches (the same plan on every rank)
    pre-pass    no-grad forward where needed: proximal log-probs (several updates per
                batch, or KL in the reward), reference log-probs (KL), values (PPO critic)
    advantages  on the whole batch (group baselines need whole groups)
    updates     per mini-batch: forward/backward each micro-batch, accumulate, clip, step

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
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from asyncrl.config import Config
from asyncrl.core.reductions import Reduction, Stat
from asyncrl.learner import microbatch
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    aggregate,
    batch_kl,
    compute_advantages,
    kl_estimate,
    make_kl_controller,
    needs_of,
    off_policy_metrics,
    policy_loss,
    token_level_rewards,
    value_loss,
)
from asyncrl.learner.algorithms.corrections import PEAK_STATS
from asyncrl.learner.algorithms.off_policy import SEQUENCE_MEAN_KEYS
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.batch_correction import BatchCorrection, correct_batch
from asyncrl.learner.distributed import Ranks
from asyncrl.learner.packing import Layout, token_outputs
from asyncrl.learner.reference import Reference

SKIP_WARNING_EVERY_S = 60.0
"""At most one warning per this many seconds about skipped non-finite updates."""

log = logging.getLogger("asyncrl.learner")


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

    def _plan(
        self, batch: TrainBatch
    ) -> tuple[list[int], list[microbatch.Plan], list[list[list[int]]]]:
        """Sequence lengths, the mini-batch plans (the same on every rank), and this rank's
        part of them: ``mine[update][micro_batch]`` -> rows."""
        learner = self.config.learner
        lengths = batch.attention_mask.sum(1).tolist()
        plans = microbatch.minibatch_plans(
            lengths,
            self.ranks.world_size,
            learner.max_tokens_per_microbatch,
            learner.minibatches,
        )
        mine = [plan[self.ranks.rank] for plan in plans]  # [update][micro_batch] -> rows
        return lengths, plans, mine

    def proximal_logprobs(self, batch: TrainBatch) -> dict[str, torch.Tensor]:
        """The pre-pass: what the update needs of the weights before this batch changes
        them, as full-batch [B, L-1] tensors (no grad). ``proximal``, their log-probs,
        where the first update's own would not do (several updates per batch unless
        bypassed, KL in the reward, or a whole-batch correction); ``reference`` (KL) and
        ``values`` (PPO critic) from the same forward passes; ``{}`` when nothing is
        needed."""
        learner, algorithm = self.config.learner, self.algorithm
        lengths, _, mine = self._plan(batch)
        needs_proximal = (
            (learner.minibatches > 1 and not algorithm.bypass)
            or self.needs.kl_in_reward
            or algorithm.needs_proximal_pass
        )
        return self._pre_pass(
            batch, [m for update in mine for m in update], lengths, needs_proximal
        )

    def step(
        self, batch: TrainBatch, pre: dict[str, torch.Tensor], version: int
    ) -> dict[str, float]:
        """Train on ``batch`` (policy ``version``), given its :meth:`proximal_logprobs`."""
        algorithm, learner = self.algorithm, self.config.learner
        lengths, plans, mine = self._plan(batch)
        extra: dict[str, float] = {}

        correction = BatchCorrection(batch.loss_mask)
        if algorithm.needs_proximal_pass:  # rejected tokens leave the loss and its counts
            correction = correct_batch(
                algorithm, pre["proximal"], batch.behavior_logprobs, batch.loss_mask
            )
            batch = replace(batch, loss_mask=correction.loss_mask)
            extra |= correction.metrics

        kl_reward = None
        if self.needs.kl_in_reward:
            kl_reward = kl_estimate(pre["proximal"], pre["reference"], algorithm.kl_estimator)
        token_rewards = None
        if self.needs.token_rewards:
            token_rewards = token_level_rewards(
                batch.rewards, batch.loss_mask, kl=kl_reward, kl_coef=self.kl_control.value
            )
        if kl_reward is not None:
            current = batch_kl(kl_reward, batch.loss_mask)
            extra |= {"kl_reward": current, "kl_coef": self.kl_control.value}
            self.kl_control.update(current, n_samples=batch.num_samples)
        advantages, returns = compute_advantages(
            algorithm.advantage,
            rewards=batch.rewards,
            group_ids=batch.group_ids,
            mask=batch.loss_mask,
            values=pre.get("values"),
            token_rewards=token_rewards,
            **ADVANTAGES[algorithm.advantage].knobs_of(algorithm),
        )

        reduction = Reduction()
        self.positions = 0
        for number, (plan, update) in enumerate(zip(plans, mine, strict=True)):
            everyone = torch.tensor([i for rank in plan for rows in rank for i in rows])
            normalizers = {
                "num_tokens": batch.loss_mask[everyone].sum().item(),
                "num_sequences": self._sequences(batch.loss_mask[everyone]),
                "norm_length": self.config.generators.max_new_tokens,
            }
            self.optimizer.zero_grad(set_to_none=True)
            parts = microbatch.micro_batches(update, lengths)
            loss = 0.0  # this rank's share of the mini-batch's objective
            for index, part in enumerate(parts):
                self.model.set_requires_gradient_sync(index == len(parts) - 1)
                stats, part_loss = self._micro_step(
                    batch, part, advantages, returns, pre, normalizers, version, correction
                )
                loss += part_loss
                reduction.update(stats)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), learner.grad_clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            norm = grad_norm.item()  # the global norm: the same on every rank
            reduction.add("learner_grad_norm", Stat.mean(norm, 1.0))
            loss = self._summed_over_ranks(loss)
            if math.isfinite(loss) and math.isfinite(norm):
                self.optimizer.step()
            else:  # a NaN or inf would reach the weights and the optimizer state
                self.optimizer.zero_grad(set_to_none=True)
                self._skip_nonfinite(version, number, len(plans), loss, norm)
        return (
            self._reduce(reduction)
            | {
                "advantage_abs_mean": advantages[batch.loss_mask.bool()].abs().mean().item()
                if batch.loss_mask.any()
                else 0.0,
                "learner_minibatches": float(len(mine)),
                "learner_microbatches": float(sum(len(update) for update in mine)),
                "learner_positions": self._summed_over_ranks(float(self.positions)),
                "learner_skipped_nonfinite_total": float(self.skipped_nonfinite),
            }
            | extra
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
        return {name: tensor.cpu() for name, tensor in out.items()}

    def _micro_step(
        self,
        batch: TrainBatch,
        part: microbatch.MicroBatch,
        advantages: torch.Tensor,
        returns: torch.Tensor | None,
        pre: dict[str, torch.Tensor],
        normalizers: dict[str, float],
        version: int,
        correction: BatchCorrection,
    ) -> tuple[dict[str, Stat], float]:
        """Forward and backward one micro-batch; returns its statistics, each with how it
        combines with the other micro-batches' and ranks', and the value of the objective
        that was back-propagated."""
        algorithm, device = self.algorithm, self.ranks.device
        mask = part.tokens(batch.loss_mask, device) * part.weight
        behavior = part.tokens(batch.behavior_logprobs, device)

        inputs = self.layout.input(part, batch, device)
        self.positions += inputs.positions
        entropy_term = "loss" if algorithm.entropy_coef > 0 else "metric"
        outputs = token_outputs(self.model, inputs, self.temperature, entropy=entropy_term)
        logprobs, values, entropy = outputs.logprobs, outputs.values, outputs.entropy
        if algorithm.bypass:  # pi_prox = pi_b: the ratio is to the behavior policy itself
            proximal = behavior
        elif "proximal" in pre:
            proximal = part.tokens(pre["proximal"], device)
        else:
            proximal = logprobs.detach()
        loss, stats = policy_loss(
            logprobs,
            proximal,
            behavior,
            part.tokens(advantages, device),
            mask,
            loss=algorithm.policy_loss,
            clip_low=algorithm.clip_low,
            clip_high=algorithm.clip_high,
            clip_c=algorithm.clip_c,
            sapo_tau_pos=algorithm.sapo_tau_pos,
            sapo_tau_neg=algorithm.sapo_tau_neg,
            correction=algorithm.correction,
            correction_level=algorithm.correction_level,
            correction_cap=algorithm.correction_cap,
            correction_floor=algorithm.correction_floor,
            weight_scale=correction.weight_scale,
            aggregation=algorithm.aggregation,
            **normalizers,
        )
        training = logprobs.detach() if algorithm.bypass else proximal
        off_policy = off_policy_metrics(training, behavior, mask, algorithm.correction_cap)
        out = {
            f"learner_{key}" if not key.startswith("importance") else key: v
            for key, v in stats.items()
        }
        agg = {"mode": algorithm.aggregation, **normalizers}
        total = loss
        out["loss_policy"] = loss.detach()
        if values is not None:
            v_loss, v_stats = value_loss(
                values,
                part.tokens(pre["values"], device),
                part.tokens(returns, device),
                mask,
                clip=algorithm.value_clip,
                aggregation=algorithm.aggregation,
                **normalizers,
            )
            total = total + algorithm.value_coef * v_loss
            out["loss_value"] = v_loss.detach()
            out |= {f"learner_{key}": value for key, value in v_stats.items()}
        if self.reference is not None:
            reference = part.tokens(pre["reference"], device)
            kl = kl_estimate(logprobs, reference, algorithm.kl_estimator)
            kl_term = aggregate(kl, mask, **agg)
            if self.needs.kl_in_loss:
                total = total + algorithm.kl_coef * kl_term
            out["learner_kl"] = kl_term.detach()
        if algorithm.entropy_coef > 0:
            total = total - algorithm.entropy_coef * aggregate(entropy, mask, **agg)
        (total * self.ranks.world_size).backward()
        total_value = total.item()

        with torch.no_grad():
            tokens = float(mask.sum().item())
            weight = tokens / max(normalizers["num_tokens"], 1.0)
            current = (part.tokens(batch.token_versions, device) == version) & mask.bool()
            # Losses are normalised by global counts already: they add up as they are.
            result = {
                key: Stat.total(float(value))
                if key.startswith("loss_")
                else Stat.peak(float(value))
                if key in PEAK_STATS
                else Stat.mean(float(value), weight)
                for key, value in out.items()
            }
            result["learner_entropy"] = Stat.mean(
                float((entropy * mask).sum() / max(tokens, 1.0)), weight
            )
            sequences = float(mask.bool().any(-1).sum().item())
            for key, value in off_policy.items():
                per = sequences if key in SEQUENCE_MEAN_KEYS else weight
                result[key] = Stat.mean(float(value), per)
            # Tokens sampled with the weights being trained: generator and learner
            # should agree on them up to numerics (null in metrics.jsonl if there are none).
            mismatch = (proximal - behavior).abs()[current]
            result["logprob_mismatch"] = Stat.mean(
                mismatch.mean().item() if mismatch.numel() else 0.0, float(mismatch.numel())
            )
        return result, total_value

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
