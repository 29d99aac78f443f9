"""Typed registries of the RL math's plug-in points, and what each plug-in needs.

The learner never tests an algorithm's name: it looks the configured name up here and
reads what the entry needs (the critic's values, per-token rewards, a reference model).
Five registries, one per config key:

=================  ======================  ==============================================
registry           config key              entry
=================  ======================  ==============================================
``ADVANTAGES``     ``algorithm.advantage`` :class:`AdvantageEstimator`
``CORRECTIONS``    ``algorithm.correction`` :class:`Correction`
``AGGREGATIONS``   ``algorithm.aggregation`` :class:`Aggregation`
``KL_ESTIMATORS``  ``algorithm.kl_estimator`` :class:`KLEstimator`
``POLICY_LOSSES``  ``algorithm.policy_loss``  :class:`PolicyLoss`
=================  ======================  ==============================================

An advantage estimator is registered together with its config class (a subclass of
:class:`~asyncrl.config.AlgorithmConfig` holding only its own knobs), which
:func:`register_advantage` also files with the config schema, so the config accepts the
new name and rejects the knobs it does not take. docs/learner.md, "Adding an
estimator", shows one end to end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from asyncrl.config import AlgorithmConfig, CriticConfig, register_advantage_config

Tensor = torch.Tensor
Entry = TypeVar("Entry")


class Registry(dict[str, Entry], Generic[Entry]):
    """Entries by config name; looking up an unknown name raises ``ValueError`` naming
    the known ones."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def __missing__(self, name: str) -> Entry:
        raise ValueError(f"unknown {self.kind} {name!r}; expected one of: {', '.join(self)}")

    def add(self, name: str, entry: Entry) -> Entry:
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self[name] = entry
        return entry


@dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage estimator and what it needs.

    ``fn`` is called with keyword arguments: ``rewards [B], group_ids [B]`` and returns
    ``[B]`` when ``per_sample`` (broadcast to the sample's tokens by
    :func:`~asyncrl.learner.algorithms.compute_advantages`), else ``token_rewards [B, T],
    mask [B, T]`` (and ``values [B, T]`` when ``needs_values``) and returns ``[B, T]``;
    plus the knobs of ``config`` (its fields beyond :class:`AlgorithmConfig`'s), by name.
    """

    name: str
    fn: Callable[..., Tensor | tuple[Tensor, Tensor]]
    config: type[AlgorithmConfig]
    per_sample: bool = False
    """One advantage per sample from its scalar reward (a group baseline)."""
    needs_values: bool = False
    """The critic's values [B, T]: the policy gets a value head, and ``fn`` returns
    ``(advantages, returns)``, the value head's targets."""
    needs_token_rewards: bool = False
    """Per-token rewards [B, T] (the outcome on the last token, minus a KL in the reward)."""

    @property
    def knobs(self) -> tuple[str, ...]:
        """Keys of this estimator's config beyond every algorithm's (and the value loss's,
        :class:`~asyncrl.config.CriticConfig`): passed to ``fn`` by name."""
        shared = CriticConfig.model_fields  # a superset of AlgorithmConfig's
        return tuple(k for k in self.config.model_fields if k not in shared)

    def knobs_of(self, algorithm: AlgorithmConfig) -> dict[str, Any]:
        return {knob: getattr(algorithm, knob) for knob in self.knobs}


class CorrectionWeight(Protocol):
    """A correction's rule: ``w = weight(rho, cap, floor)``, elementwise on detached rho."""

    def __call__(self, rho: Tensor, cap: float, floor: float) -> Tensor: ...


@dataclass(frozen=True)
class Correction:
    """Behavior correction: the token weight ``w`` from ``rho = pi_prox / pi_b``.

    ``weight(rho, cap, floor)`` maps rho [B, T] (detached, at the chosen level) to w [B, T];
    ``cap`` is C, ``floor`` the lower threshold (``algorithm.correction_floor``, else 1/C)."""

    name: str
    weight: CorrectionWeight
    uses_cap: bool
    """Whether ``algorithm.correction_cap`` changes w (it always counts the truncated stat)."""
    uses_floor: bool = False
    """Whether ``algorithm.correction_floor`` changes w."""
    knobs: ClassVar[tuple[str, ...]] = ("correction_level", "correction_cap", "correction_floor")
    """The keys every correction reads: where rho is taken, and the cap and the floor (its
    thresholds where ``uses_cap``/``uses_floor``, the truncated and below-floor stats
    always)."""

    def knobs_of(self, algorithm: AlgorithmConfig) -> dict[str, Any]:
        """This correction's knobs as the algorithm section sets them, by their keys."""
        return {knob: getattr(algorithm, knob) for knob in self.knobs}


@dataclass(frozen=True)
class Aggregation:
    """Token losses [B, T] (0 where masked) to a scalar: a sum over rows divided by a
    normalizer, so micro-batch results add up (see :func:`~.aggregation.aggregate`).

    ``fn(values, mask, num_tokens, num_sequences, norm_length)`` gets the global
    normalizers (``None``: local counts)."""

    name: str
    fn: Callable[..., Tensor]
    counts_empty_rows: bool = False
    """Whether ``num_sequences`` counts rows without a valid token (Dr. GRPO's constant
    normalizer does; the seq-mean modes count the rows with one, as verl)."""


@dataclass(frozen=True)
class KLEstimator:
    """Per-token KL(pi || pi_ref) from ``log_ratio = logprobs - ref_logprobs`` [B, T]."""

    name: str
    fn: Callable[[Tensor], Tensor]
    unbiased: bool
    non_negative: bool


@dataclass(frozen=True)
class PolicyLoss:
    """A policy-loss surrogate (:mod:`~.surrogates`) and the knobs it takes.

    ``fn`` is called with the keyword tensors ``logprobs, log_ratio, advantages, mask,
    weight`` [B, T] (masked, see :mod:`~.surrogates`) and the knobs named in ``knobs``
    (``algorithm`` keys, passed to :func:`~.policy_loss.policy_loss` by name; a knob not
    given takes ``fn``'s default), and returns a :class:`~.surrogates.Surrogate`."""

    name: str
    fn: Callable[..., Any]
    knobs: tuple[str, ...]
    """The loss knobs it reads, among ``clip_low, clip_high, clip_c, sapo_tau_pos,
    sapo_tau_neg``; a dual clip (``clip_c``) set for a loss that does not read it is an
    error."""

    def knobs_of(self, algorithm: AlgorithmConfig) -> dict[str, Any]:
        """This loss's knobs as the algorithm section sets them, as an estimator's."""
        return {knob: getattr(algorithm, knob) for knob in self.knobs}


ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage")
CORRECTIONS: Registry[Correction] = Registry("correction")
AGGREGATIONS: Registry[Aggregation] = Registry("aggregation")
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def register_advantage(
    name: str,
    *,
    config: type[AlgorithmConfig],
    per_sample: bool = False,
    needs_values: bool = False,
    needs_token_rewards: bool = False,
) -> Callable[[Callable], Callable]:
    """Decorator: file an advantage estimator and its config class under ``name``."""
    if needs_values and not issubclass(config, CriticConfig):
        raise TypeError(
            f"advantage {name!r} needs values, so its config must derive from CriticConfig "
            "(value_clip, value_coef: the value head's loss)"
        )

    def wrap(fn: Callable) -> Callable:
        register_advantage_config(name, config)
        ADVANTAGES.add(
            name,
            AdvantageEstimator(name, fn, config, per_sample, needs_values, needs_token_rewards),
        )
        return fn

    return wrap


def register_correction(
    name: str, *, uses_cap: bool, uses_floor: bool = False
) -> Callable[[CorrectionWeight], CorrectionWeight]:
    def wrap(fn: CorrectionWeight) -> CorrectionWeight:
        CORRECTIONS.add(name, Correction(name, fn, uses_cap, uses_floor))
        return fn

    return wrap


def register_aggregation(
    name: str, *, counts_empty_rows: bool = False
) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        AGGREGATIONS.add(name, Aggregation(name, fn, counts_empty_rows))
        return fn

    return wrap


def register_kl_estimator(
    name: str, *, unbiased: bool, non_negative: bool
) -> Callable[[Callable], Callable]:
    def wrap(fn: Callable) -> Callable:
        KL_ESTIMATORS.add(name, KLEstimator(name, fn, unbiased, non_negative))
        return fn

    return wrap


def register_policy_loss(name: str, *, knobs: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """Decorator: file a surrogate under ``name`` (``algorithm.policy_loss``)."""

    def wrap(fn: Callable) -> Callable:
        POLICY_LOSSES.add(name, PolicyLoss(name, fn, knobs))
        return fn

    return wrap


@dataclass(frozen=True)
class Needs:
    """What one algorithm config asks of the learner, decided here and nowhere else."""

    values: bool
    """A value head on the policy, and the critic's values in the pre-pass."""
    token_rewards: bool
    """Per-token rewards: the estimator wants them, or the KL goes into the reward."""
    reference: bool
    """A frozen reference model (``kl_coef > 0``)."""
    kl_in_reward: bool
    """The KL is subtracted from each token's reward (needs proximal log-probs up front)."""
    kl_in_loss: bool
    """The KL is added to the loss."""


def needs_of(algorithm: AlgorithmConfig) -> Needs:
    estimator = ADVANTAGES[algorithm.advantage]
    reference = algorithm.kl_coef > 0
    kl_in_reward = reference and algorithm.kl_in == "reward"
    return Needs(
        values=estimator.needs_values,
        token_rewards=estimator.needs_token_rewards or kl_in_reward,
        reference=reference,
        kl_in_reward=kl_in_reward,
        kl_in_loss=reference and algorithm.kl_in == "loss",
    )
