"""The learner's objective: one micro-batch's loss, term by term, and its statistics.

::

    loss = policy + value_coef * value + kl_coef * KL (kl_in: loss) - entropy_coef * entropy

Each term is aggregated as ``algorithm.aggregation`` says with the mini-batch's global
normalizers, so the losses of micro-batches and ranks add up to the mini-batch's
(:func:`~asyncrl.learner.algorithms.aggregate`). :class:`Objective` reads the algorithm
section once: the surrogate's and the correction's knobs come from their registry entries
(:data:`~asyncrl.learner.algorithms.POLICY_LOSSES`, ``CORRECTIONS``), as an advantage
estimator's do. The value term is there when the model has a value head, the KL term
when the step has reference log-probs: both follow from the same config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch

from asyncrl.config import AlgorithmConfig, CriticConfig
from asyncrl.core.reductions import Stat
from asyncrl.learner.algorithms import (
    CORRECTIONS,
    POLICY_LOSSES,
    aggregate,
    kl_estimate,
    needs_of,
    off_policy_metrics,
    policy_loss,
    value_loss,
)
from asyncrl.learner.algorithms.corrections import PEAK_STATS
from asyncrl.learner.algorithms.off_policy import SEQUENCE_MEAN_KEYS

Tensor = torch.Tensor


@dataclass(frozen=True)
class Tokens:
    """One micro-batch's per-token tensors [b, width - 1], on the learner's device."""

    logprobs: Tensor
    """log pi_theta of each trained token, with grad."""
    entropy: Tensor
    """The policy's entropy per token (with grad when it is a loss term)."""
    values: Tensor | None
    """The value head's predictions, with grad; None without a value head."""
    behavior: Tensor
    """log pi_b, as the generator recorded it."""
    proximal: Tensor | None
    """log pi_prox from the pre-pass; None: the first update's own log-probs serve."""
    advantages: Tensor
    mask: Tensor
    """The loss mask times the micro-batch's weight (0 for a filler)."""
    current: Tensor
    """bool: the token was sampled with the weights being trained."""
    reference: Tensor | None = None
    """log pi_ref from the pre-pass; None: no KL term."""
    old_values: Tensor | None = None
    """The critic's values from the pre-pass (the value clip's anchor)."""
    returns: Tensor | None = None
    """The value head's targets."""


@dataclass(frozen=True)
class Normalizers:
    """The mini-batch's counts over all ranks that every aggregation divides by."""

    num_tokens: float
    num_sequences: float
    norm_length: int


@dataclass(frozen=True)
class Evaluation:
    """One micro-batch's objective: the loss to back-propagate and, once that is queued,
    its statistics (reading them waits for the device, so :meth:`stats` comes after)."""

    loss: Tensor
    terms: dict[str, Tensor]
    """The loss terms and the policy's and critic's statistics, detached, by metric name."""
    off_policy: dict[str, Tensor]
    """verl's off-policy diagnostics (:func:`~asyncrl.learner.algorithms.off_policy_metrics`)."""
    tokens: Tokens
    proximal: Tensor
    num_tokens: float
    """The mini-batch's trained tokens on all ranks: this micro-batch's weight is its share."""

    def stats(self) -> dict[str, Stat]:
        """Each statistic with how it combines with other micro-batches' and ranks'."""
        tokens, mask = self.tokens, self.tokens.mask
        with torch.no_grad():
            count = float(mask.sum().item())
            weight = count / max(self.num_tokens, 1.0)
            # Losses are normalised by global counts already: they add up as they are.
            result = {
                key: Stat.total(float(value))
                if key.startswith("loss_")
                else Stat.peak(float(value))
                if key in PEAK_STATS
                else Stat.mean(float(value), weight)
                for key, value in self.terms.items()
            }
            result["learner_entropy"] = Stat.mean(
                float((tokens.entropy * mask).sum() / max(count, 1.0)), weight
            )
            sequences = float(mask.bool().any(-1).sum().item())
            for key, value in self.off_policy.items():
                per = sequences if key in SEQUENCE_MEAN_KEYS else weight
                result[key] = Stat.mean(float(value), per)
            # Tokens sampled with the weights being trained: generator and learner
            # should agree on them up to numerics (null in metrics.jsonl if there are none).
            mismatch = (self.proximal - tokens.behavior).abs()[tokens.current & mask.bool()]
            result["logprob_mismatch"] = Stat.mean(
                mismatch.mean().item() if mismatch.numel() else 0.0, float(mismatch.numel())
            )
        return result


class Objective:
    """The configured loss, built once from the algorithm section, called per micro-batch."""

    def __init__(self, algorithm: AlgorithmConfig):
        self.bypass = algorithm.bypass
        """pi_prox = pi_b: the ratio is to the behavior policy itself."""
        self.policy_knobs = {
            "loss": algorithm.policy_loss,
            **POLICY_LOSSES[algorithm.policy_loss].knobs_of(algorithm),
            "correction": algorithm.correction,
            **CORRECTIONS[algorithm.correction].knobs_of(algorithm),
        }
        """:func:`~asyncrl.learner.algorithms.policy_loss`'s knobs: the surrogate's and the
        correction's, each read from the section by its registry entry."""
        self.aggregation = algorithm.aggregation
        self.correction_cap = algorithm.correction_cap
        self.value_clip: float | None = None
        self.value_coef = 0.0
        if isinstance(algorithm, CriticConfig):  # an estimator that trains a value head
            self.value_clip, self.value_coef = algorithm.value_clip, algorithm.value_coef
        self.kl_estimator = algorithm.kl_estimator
        self.kl_coef = algorithm.kl_coef
        self.kl_in_loss = needs_of(algorithm).kl_in_loss
        self.entropy_coef = algorithm.entropy_coef

    @property
    def entropy(self) -> Literal["loss", "metric"]:
        """What the forward pass computes the entropy for: a loss term needs its grad."""
        return "loss" if self.entropy_coef > 0 else "metric"

    def __call__(
        self, tokens: Tokens, normalizers: Normalizers, weight_scale: float = 1.0
    ) -> Evaluation:
        """The micro-batch's loss (its share of the mini-batch's) and its statistics."""
        counts = asdict(normalizers)
        proximal = self._proximal(tokens)
        policy, stats = policy_loss(
            tokens.logprobs,
            proximal,
            tokens.behavior,
            tokens.advantages,
            tokens.mask,
            weight_scale=weight_scale,
            aggregation=self.aggregation,
            **self.policy_knobs,
            **counts,
        )
        training = tokens.logprobs.detach() if self.bypass else proximal
        off_policy = off_policy_metrics(training, tokens.behavior, tokens.mask, self.correction_cap)
        terms = {
            f"learner_{key}" if not key.startswith("importance") else key: value
            for key, value in stats.items()
        }
        terms["loss_policy"] = policy.detach()
        total = policy
        if tokens.values is not None:
            total = total + self.value_coef * self._value_term(tokens, counts, terms)
        if tokens.reference is not None:
            kl = kl_estimate(tokens.logprobs, tokens.reference, self.kl_estimator)
            kl_term = aggregate(kl, tokens.mask, self.aggregation, **counts)
            if self.kl_in_loss:
                total = total + self.kl_coef * kl_term
            terms["learner_kl"] = kl_term.detach()
        if self.entropy_coef > 0:
            entropy = aggregate(tokens.entropy, tokens.mask, self.aggregation, **counts)
            total = total - self.entropy_coef * entropy
        return Evaluation(total, terms, off_policy, tokens, proximal, normalizers.num_tokens)

    def _proximal(self, tokens: Tokens) -> Tensor:
        """pi_prox: pi_b under bypass, else the pre-pass's, else the first update's own."""
        if self.bypass:
            return tokens.behavior
        if tokens.proximal is not None:
            return tokens.proximal
        return tokens.logprobs.detach()

    def _value_term(
        self, tokens: Tokens, counts: dict[str, float], terms: dict[str, Tensor]
    ) -> Tensor:
        """The critic's clipped loss; its value and stats go into ``terms``."""
        assert tokens.values is not None
        loss, stats = value_loss(
            tokens.values,
            tokens.old_values,
            tokens.returns,
            tokens.mask,
            clip=self.value_clip,
            aggregation=self.aggregation,
            **counts,
        )
        terms["loss_value"] = loss.detach()
        terms |= {f"learner_{key}": value for key, value in stats.items()}
        return loss
