"""What a step's micro-batches train towards, decided on the whole batch before any update.

Group baselines need whole groups and whitening the whole batch, and the whole-batch
corrections (:mod:`.batch_correction`) look at every token at once, so this runs once per
step, where the batch lives (the learner's device, where :func:`~.batch.collate` puts it):
the corrections trim the loss mask, the KL to the reference goes into the rewards when
``kl_in: reward``, and the configured estimator turns the rewards into advantages. The
pre-pass's results are read where they are; a batch held elsewhere gets a copy of the
ones it needs, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from asyncrl.config import AlgorithmConfig
from asyncrl.learner.algorithms import (
    ADVANTAGES,
    KLController,
    Needs,
    batch_kl,
    compute_advantages,
    kl_estimate,
    token_level_rewards,
)
from asyncrl.learner.batch import TrainBatch
from asyncrl.learner.batch_correction import correct_batch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Targets:
    """The batch as it trains (the rejected tokens out of its loss mask) and its targets."""

    batch: TrainBatch
    advantages: Tensor
    """[B, L-1], 0 where the loss mask is."""
    returns: Tensor | None
    """The value head's targets, for an estimator that needs values."""
    weight_scale: float = 1.0
    """The behavior weights are divided by this (``correction_batch_normalize``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The corrections' and the in-reward KL's statistics."""


def batch_targets(
    algorithm: AlgorithmConfig,
    needs: Needs,
    kl_control: KLController,
    batch: TrainBatch,
    pre: dict[str, Tensor],
) -> Targets:
    """Corrections, the KL in the reward (``kl_control`` then steps), and the advantages
    of ``batch``, from its pre-pass results ``pre``."""
    wanted = {
        "proximal": algorithm.needs_proximal_pass or needs.kl_in_reward,
        "reference": needs.kl_in_reward,
        "values": needs.values,
    }
    device = batch.loss_mask.device
    here = {name: pre[name].to(device) for name, used in wanted.items() if used}
    metrics: dict[str, float] = {}
    weight_scale = 1.0
    if algorithm.needs_proximal_pass:  # rejected tokens leave the loss and its counts
        correction = correct_batch(
            algorithm, here["proximal"], batch.behavior_logprobs, batch.loss_mask
        )
        batch = replace(batch, loss_mask=correction.loss_mask)
        weight_scale = correction.weight_scale
        metrics |= correction.metrics

    kl_reward = None
    if needs.kl_in_reward:
        kl_reward = kl_estimate(here["proximal"], here["reference"], algorithm.kl_estimator)
    token_rewards = None
    if needs.token_rewards:
        token_rewards = token_level_rewards(
            batch.rewards, batch.loss_mask, kl=kl_reward, kl_coef=kl_control.value
        )
    if kl_reward is not None:
        current = batch_kl(kl_reward, batch.loss_mask)
        metrics |= {"kl_reward": current, "kl_coef": kl_control.value}
        kl_control.update(current, n_samples=batch.num_samples)
    advantages, returns = compute_advantages(
        algorithm.advantage,
        rewards=batch.rewards,
        group_ids=batch.group_ids,
        mask=batch.loss_mask,
        values=here.get("values"),
        token_rewards=token_rewards,
        **ADVANTAGES[algorithm.advantage].knobs_of(algorithm),
    )
    return Targets(batch, advantages, returns, weight_scale, metrics)
