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
)
from pydantic_core import InitErrorDetails

from asyncrl.config.base import Section
from asyncrl.envs.config import Float

DEFAULT_ADVANTAGE = "grpo"


class AlgorithmConfig(Section):
    """Knobs every algorithm has; an estimator's config subclasses it and names itself
    in ``advantage`` (a ``Literal`` with that one name as its default)."""

    group_size: StrictInt = Field(8, ge=1, le=4096)
    """Samples generated per prompt (one group; GRPO normalises within it)."""
    prompts_per_step: StrictInt = Field(8, ge=1, le=65536)
    """Groups in one learner batch."""
    advantage: str
    """Advantage estimator: `grpo`, `dr_grpo`, `rloo`, `reinforce_pp`, `gae` (PPO with a
    critic, a value head), or one registered by a plug-in; the rest of its knobs are its own."""
    clip_low: Float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip below: the ratio pi_theta/pi_prox is clipped at 1 - clip_low."""
    clip_high: Float = Field(0.2, ge=0.0)
    """PPO clip above: clipped at 1 + clip_high (DAPO's clip-higher raises it)."""
    clip_c: Float | None = Field(None, gt=1.0)
    """Dual clip: for negative advantages the loss is at most -clip_c * A; empty disables."""
    correction: Literal["none", "tis", "mis", "decoupled"] = "tis"
    """Behavior correction w(rho = pi_prox/pi_behavior): tis min(rho, C), mis 0 above C, none 1."""
    correction_level: Literal["token", "sequence"] = "token"
    """Ratio per token, or per sequence (the geometric mean of its token ratios)."""
    correction_cap: Float = Field(2.0, gt=0.0)
    """C, the truncation (tis) or masking (mis) threshold of the behavior importance weight."""
    aggregation: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """How token losses become one number; `seq-mean-token-sum-norm` is Dr. GRPO's."""
    kl_coef: Float = Field(0.0, ge=0.0)
    """Weight of the KL to a frozen reference model; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (Schulman): k1 log-ratio, k2 half its square, k3 non-negative."""
    kl_in: Literal["loss", "reward"] = "loss"
    """Where the KL penalty goes: added to the loss, or subtracted from each token's reward."""
    entropy_coef: Float = Field(0.0, ge=0.0)
    """Entropy bonus: subtract entropy_coef * entropy from the loss; 0 disables."""

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


for _config in (GrpoConfig, DrGrpoConfig, RlooConfig, ReinforcePPConfig, GaeConfig):
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
