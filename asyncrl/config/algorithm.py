"""The algorithm section: knobs every algorithm has, plus the chosen estimator's own.

``algorithm.advantage`` picks the estimator, and with it the config class that
validates the section: a union of estimator configs discriminated by ``advantage``
(default ``grpo``). Each estimator's config is a subclass of :class:`AlgorithmConfig`
that adds only its own knobs, so a knob the chosen estimator would ignore is an error
naming it, e.g. ``algorithm.lam: only used by advantage: gae (this config uses grpo)``.

The union is a registry, :data:`ADVANTAGE_CONFIGS`, rather than a fixed ``Union``: the
learner's :func:`~asyncrl.learner.algorithms.registry.register_advantage` files a new
estimator's config here, and the config accepts it with no other edit. The built-in
estimators' configs are filed below, so validation needs no learner import (this
package imports neither torch nor the learner).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    SerializeAsAny,
    StrictInt,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    model_validator,
)
from pydantic_core import InitErrorDetails

from asyncrl.config.base import Section
from asyncrl.config.environment import Float

DEFAULT_ADVANTAGE = "grpo"
SEQUENCE_LOSSES = ("gspo", "sapo", "gmpo")
"""Policy losses whose default aggregation is seq-mean-token-mean, as verl forces it."""


class RejectionCriterion(Section):
    """One rejection-sampling criterion: keep a token (``token``) or a sequence (the others)
    only while ``low <= statistic <= high``, the statistic being ``estimator`` of the
    log-ratio ``x = log(pi_prox / pi_b)`` per token (``ratio``: exp(x); the KL(pi_b ||
    pi_prox) estimates on pi_b's samples k1: -x, k2: x^2/2, k3: exp(x) - 1 - x; as verl's
    rollout rejection sampling), summed, averaged or maxed over the sequence's valid
    tokens. The bounds apply to the statistic itself (verl's k1 bounds are ratios: use
    their logs)."""

    statistic: Literal["token", "seq_sum", "seq_mean", "seq_max"]
    estimator: Literal["ratio", "k1", "k2", "k3"] = "ratio"
    low: Float | None = None
    """Lower bound; empty: none."""
    high: Float | None = None
    """Upper bound; empty: none."""

    @model_validator(mode="after")
    def _bounded(self) -> RejectionCriterion:
        if self.low is None and self.high is None:
            raise ValueError("a rejection criterion needs low, high or both")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low ({self.low}) is above high ({self.high})")
        return self


class AlgorithmConfig(Section):
    """Knobs every algorithm has; an estimator's config subclasses it and names itself
    in ``advantage`` (a ``Literal`` with that one name as its default)."""

    group_size: StrictInt = Field(8, ge=1, le=4096)
    """Samples generated per prompt (one group; GRPO normalises within it)."""
    prompts_per_step: StrictInt = Field(8, ge=1, le=65536)
    """Groups in one learner batch."""
    advantage: str
    """Advantage estimator: `grpo`, `dr_grpo`, `rloo`, `grpo_passk`, `reinforce_pp`,
    `reinforce_pp_baseline`, `gae` (PPO with a critic, a value head), or one registered by
    a plug-in; the rest of its knobs are its own."""
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo", "gmpo", "reinforce"] = "ppo"
    """The surrogate: `ppo` (clipped ratio), `gspo` (clipped sequence ratio, Qwen), `cispo`
    (clipped stop-gradient weight on -A log pi, MiniMax-M1), `sapo` (soft sigmoid gate, Qwen),
    `gmpo` (geometric mean of clipped token ratios), `reinforce` (-w A log pi, no clip)."""
    clip_low: Float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip below: the ratio pi_theta/pi_prox is clipped at 1 - clip_low (gmpo: the
    log-ratio at -clip_low)."""
    clip_high: Float = Field(0.2, ge=0.0)
    """PPO clip above: clipped at 1 + clip_high (DAPO's clip-higher raises it)."""
    clip_c: Float | None = Field(None, gt=1.0)
    """Dual clip: for negative advantages the loss is at most -clip_c * A; empty disables."""
    sapo_tau_pos: Float = Field(1.0, gt=0.0)
    """SAPO's gate temperature for positive advantages."""
    sapo_tau_neg: Float = Field(1.05, gt=0.0)
    """SAPO's gate temperature for negative advantages (steeper: negative tokens are riskier)."""
    bypass: bool = False
    """verl's bypass mode: the behavior policy is the proximal one, so the ratio is
    pi_theta/pi_behavior, clipped, with no behavior weight and no proximal pre-pass."""
    correction: Literal["none", "tis", "mis", "icepop", "decoupled"] = "tis"
    """Behavior correction w(rho = pi_prox/pi_behavior): tis min(rho, C), mis 0 above C,
    icepop 0 outside [floor, C], decoupled rho, none 1."""
    correction_level: Literal["token", "sequence", "geometric"] = "token"
    """Ratio per token; per sequence as the product of its token ratios (verl's sequence
    level); or per sequence as their geometric mean."""
    correction_cap: Float = Field(2.0, gt=0.0)
    """C, the truncation (tis) or masking (mis, icepop) threshold of the behavior weight."""
    correction_floor: Float | None = Field(None, gt=0.0)
    """IcePop's lower threshold; empty: 1 / correction_cap."""
    correction_batch_normalize: bool = False
    """Divide the weights by their mean over the batch's valid tokens (sequences at a
    sequence level), so they average 1 (needs a proximal pre-pass)."""
    rejection: list[RejectionCriterion] = Field(default_factory=list)
    """Rejection sampling: drop a token or a whole sequence from the loss (and its
    normalizer) when a statistic of log(pi_prox/pi_b) is outside [low, high]; the
    criteria are ANDed (each must hold to keep). Needs a proximal pre-pass."""
    m2po_threshold: Float | None = Field(None, gt=0.0)
    """M2PO: mask the tokens with the largest (log rho)^2 until the second moment of the
    rest is at most this (the paper uses 0.04); empty disables. Needs a proximal pre-pass."""
    aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number; `seq-mean-token-sum-norm` is Dr. GRPO's."""
    kl_coef: Float = Field(0.0, ge=0.0)
    """Weight of the KL to a frozen reference model; 0 loads no reference model. With the
    adaptive controller, its starting value."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = "k3"
    """Per-token KL estimator (Schulman): k1 log-ratio, k2 half its square, k3 non-negative,
    abs its absolute value."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: added to the loss, or subtracted from each token's reward."""
    kl_controller: Literal["fixed", "adaptive"] = "fixed"
    """`adaptive`: the in-reward KL coefficient follows kl_target (Ziegler et al.'s
    proportional controller, as verl); needs kl_in: reward."""
    kl_target: Float = Field(0.1, gt=0.0)
    """The adaptive controller's target KL per token (mean over the batch)."""
    kl_horizon: Float = Field(10000.0, gt=0.0)
    """The adaptive controller's horizon, in samples."""
    entropy_coef: Float = Field(0.0, ge=0.0)
    """Entropy bonus: subtract entropy_coef * entropy from the loss; 0 disables."""

    @model_validator(mode="before")
    @classmethod
    def _sequence_losses_aggregate_as_verl(cls, data: Any) -> Any:
        """gspo, sapo and gmpo are sequence-level objectives that verl always aggregates as
        seq-mean-token-mean: that is their default here too (an explicit key wins)."""
        if (
            isinstance(data, dict)
            and data.get("policy_loss") in SEQUENCE_LOSSES
            and "aggregation" not in data
        ):
            data = {**data, "aggregation": "seq-mean-token-mean"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.clip_c is not None and self.policy_loss != "ppo":
            raise ValueError(
                f"clip_c (the dual clip) is a ppo knob; policy_loss {self.policy_loss} has none"
            )
        if self.kl_controller == "adaptive" and (self.kl_in != "reward" or self.kl_coef == 0):
            raise ValueError(
                "kl_controller: adaptive steers the in-reward KL: it needs kl_in: reward "
                "and kl_coef > 0 (the starting coefficient)"
            )
        cap, floor = self.correction_cap, self.correction_floor
        if floor is not None and floor >= cap:
            raise ValueError(f"correction_floor ({floor}) must be below correction_cap ({cap})")
        behavior_only = {
            "correction_batch_normalize": self.correction_batch_normalize,
            "rejection": bool(self.rejection),
            "m2po_threshold": self.m2po_threshold is not None,
        }
        if self.bypass and any(behavior_only.values()):
            used = ", ".join(key for key, on in behavior_only.items() if on)
            raise ValueError(
                f"bypass: true makes pi_prox = pi_behavior, so {used} would change nothing"
            )
        return self

    @property
    def needs_proximal_pass(self) -> bool:
        """Whether a correction needs pi_prox of the whole batch before the first update."""
        return bool(
            self.correction_batch_normalize or self.rejection or self.m2po_threshold is not None
        )

    @property
    def samples_per_step(self) -> int:
        return self.group_size * self.prompts_per_step


class GrpoConfig(AlgorithmConfig):
    """GRPO: the group's mean reward is the baseline."""

    advantage: Literal["grpo"] = "grpo"
    normalize_std: bool = True
    """Divide by the group's reward std (off gives Dr. GRPO's advantage)."""


class DrGrpoConfig(AlgorithmConfig):
    """Dr. GRPO: the group's mean, never divided by its std."""

    advantage: Literal["dr_grpo"] = "dr_grpo"


class RlooConfig(AlgorithmConfig):
    """RLOO: the mean of the other samples of the group is the baseline."""

    advantage: Literal["rloo"] = "rloo"


class GrpoPasskConfig(AlgorithmConfig):
    """Pass@k GRPO: only the group's best sample learns, from the best minus the second."""

    advantage: Literal["grpo_passk"] = "grpo_passk"
    normalize_std: bool = True
    """Divide by the group's reward std (verl's norm_adv_by_std_in_grpo)."""

    @model_validator(mode="after")
    def _groups_of_two(self) -> GrpoPasskConfig:
        if self.group_size < 2:
            raise ValueError("advantage: grpo_passk compares a group's two best: group_size >= 2")
        return self


class ReinforcePPBaselineConfig(AlgorithmConfig):
    """REINFORCE++-baseline: the group's mean is the baseline, then whitened over the batch."""

    advantage: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"


class DiscountedConfig(AlgorithmConfig):
    """Knob of the estimators that sum per-token rewards into returns."""

    gamma: Float = Field(1.0, ge=0.0, le=1.0)
    """Discount over response tokens."""


class ReinforcePPConfig(DiscountedConfig):
    """REINFORCE++: the discounted return, whitened over the batch."""

    advantage: Literal["reinforce_pp"] = "reinforce_pp"


class CriticConfig(AlgorithmConfig):
    """Knobs of an estimator that trains a critic (a value head): its loss."""

    value_clip: Float | None = Field(0.2, gt=0.0)
    """Clip the value head's change per update to +-value_clip; empty disables."""
    value_coef: Float = Field(0.5, ge=0.0)
    """Weight of the value loss added to the policy loss."""


class GaeConfig(DiscountedConfig, CriticConfig):
    """PPO with a critic: GAE(gamma, lambda) advantages."""

    advantage: Literal["gae"] = "gae"
    lam: Float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""


ADVANTAGE_CONFIGS: dict[str, type[AlgorithmConfig]] = {}
"""Estimator config classes by ``algorithm.advantage``: the members of the union."""


def register_advantage_config(name: str, config: type[AlgorithmConfig]) -> None:
    """File ``config`` as the section of ``advantage: name`` (again with the same class: no-op)."""
    if not issubclass(config, AlgorithmConfig):
        raise TypeError(f"{config.__name__} must subclass AlgorithmConfig")
    if config.model_fields["advantage"].default != name:
        raise TypeError(f"{config.__name__}.advantage must default to {name!r}")
    known = ADVANTAGE_CONFIGS.setdefault(name, config)
    if known is not config:
        raise ValueError(f"advantage {name!r} has a config already: {known.__name__}")


for _config in (
    GrpoConfig,
    DrGrpoConfig,
    RlooConfig,
    GrpoPasskConfig,
    ReinforcePPConfig,
    ReinforcePPBaselineConfig,
    GaeConfig,
):
    register_advantage_config(_config.model_fields["advantage"].default, _config)


def algorithm_keys() -> list[str]:
    """Every key the section can take, under some estimator (for suggestions)."""
    keys = list(AlgorithmConfig.model_fields)
    for config in ADVANTAGE_CONFIGS.values():
        keys += [key for key in config.model_fields if key not in keys]
    return keys


def _users(key: str) -> list[str]:
    return [name for name, config in ADVANTAGE_CONFIGS.items() if key in config.model_fields]


SAVED_RUN = "saved_run"
"""Validation context key: the config is one asyncrl saved (``RUN_DIR/config.yaml``).
Earlier versions saved every estimator's knobs, which the chosen estimator ignored;
such a knob is then dropped (and named in the context's list) instead of refused, so
a run saved before the section was split still resumes."""


def _validate_algorithm(value: Any, handler: Any, info: ValidationInfo) -> AlgorithmConfig:
    """Validate the section with the chosen estimator's config class; report a knob that
    only other estimators take, and an unknown estimator, by key, with the rest."""
    if isinstance(value, AlgorithmConfig):
        return value
    if not isinstance(value, dict):
        return ADVANTAGE_CONFIGS[DEFAULT_ADVANTAGE].model_validate(value)
    name = value.get("advantage", DEFAULT_ADVANTAGE)
    problems: list[InitErrorDetails] = []
    config = ADVANTAGE_CONFIGS.get(name) if isinstance(name, str) else None
    if config is None:
        problems.append(
            _problem(
                "advantage",
                name,
                f"unknown estimator {name!r}; expected one of: {', '.join(ADVANTAGE_CONFIGS)}",
            )
        )
        # the common keys are still checked; the others depend on the estimator meant
        config = ADVANTAGE_CONFIGS[DEFAULT_ADVANTAGE]
        value = {k: v for k, v in value.items() if k in AlgorithmConfig.model_fields}
        del value["advantage"]
    kept = {}
    for key, item in value.items():
        users = _users(key) if key not in config.model_fields else []
        dropped = (info.context or {}).get(SAVED_RUN)
        if users and dropped is not None:
            dropped.append(f"algorithm.{key} (only used by advantage: {', '.join(users)})")
        elif users:
            message = f"only used by advantage: {', '.join(users)} (this config uses {name})"
            problems.append(_problem(key, item, message))
        else:
            kept[key] = item
    try:
        validated = config.model_validate(kept)
    except ValidationError as error:
        problems += error.errors()  # type: ignore[arg-type]
    if problems:
        raise ValidationError.from_exception_data(config.__name__, problems)
    return validated


def _problem(key: str, value: Any, message: str) -> InitErrorDetails:
    return {"type": "value_error", "loc": (key,), "input": value, "ctx": {"error": message}}


AlgorithmField = Annotated[AlgorithmConfig, SerializeAsAny(), WrapValidator(_validate_algorithm)]
"""The type of ``Config.algorithm``: the estimator's config class, saved with its own knobs."""
