"""The algorithm section of the config (``asyncrl/config/algorithm.py``): its defaults,
the choices it accepts and refuses, and the warning for an uncorrected stale run.

Expected numbers are worked out by hand in the comments, not by re-running the
formula under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config import ConfigError, GrpoConfig, config_from_dict, config_warnings, load_config
from asyncrl.learner.algorithms import ADVANTAGES, AGGREGATIONS, CORRECTIONS

# ------------------------------------------------------------ the config


def _config(**algorithm):
    return {"model": {"tiny": {}}, "algorithm": algorithm}


def test_algorithm_defaults():
    algorithm = config_from_dict({"model": {"tiny": {}}}).algorithm
    assert algorithm == GrpoConfig()
    assert algorithm.advantage == "grpo" and algorithm.normalize_std
    assert algorithm.correction == "tis"
    assert algorithm.correction_level == "token"
    assert algorithm.clip_c is None
    assert algorithm.aggregation == "token-mean"
    gae = config_from_dict(_config(advantage="gae")).algorithm
    assert (gae.gamma, gae.lam) == (1.0, 1.0)
    assert (gae.value_clip, gae.value_coef) == (0.2, 0.5)
    assert (algorithm.kl_coef, algorithm.kl_estimator, algorithm.kl_in) == (0.0, "k3", "loss")
    assert algorithm.entropy_coef == 0.0


def test_algorithm_accepts_every_documented_choice():
    for advantage in ADVANTAGES:
        for correction in CORRECTIONS:
            config = config_from_dict(_config(advantage=advantage, correction=correction))
            assert config.algorithm.advantage == advantage
    for mode in AGGREGATIONS:
        assert config_from_dict(_config(aggregation=mode)).algorithm.aggregation == mode
    config = config_from_dict(
        _config(
            clip_c=3.0,
            correction_level="sequence",
            kl_coef=0.01,
            kl_estimator="k2",
            kl_in="reward",
            advantage="gae",
            gamma=0.99,
            lam=0.95,
            value_clip=None,
        )
    )
    assert config.algorithm.clip_c == 3.0 and config.algorithm.value_clip is None


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("clip_c", 1.0, "algorithm.clip_c"),
        ("clip_c", 0.5, "algorithm.clip_c"),
        ("gamma", 1.5, "algorithm.gamma"),
        ("lam", -0.1, "algorithm.lam"),
        ("kl_coef", -1.0, "algorithm.kl_coef"),
        ("entropy_coef", -1.0, "algorithm.entropy_coef"),
        ("value_coef", -1.0, "algorithm.value_coef"),
        ("correction", "vtrace", "algorithm.correction"),
        ("correction_level", "batch", "algorithm.correction_level"),
        ("aggregation", "sum", "algorithm.aggregation"),
        ("kl_estimator", "k4", "algorithm.kl_estimator"),
        ("kl_in", "advantage", "algorithm.kl_in"),
        ("advantage", "ppo", "algorithm.advantage"),
    ],
)
def test_algorithm_rejects_invalid_values(key, value, fragment):
    with pytest.raises(ConfigError) as caught:
        config_from_dict(_config(**{key: value}))
    assert fragment in str(caught.value)


def test_correction_none_with_staleness_warns_naming_both_keys_and_the_risk():
    config = config_from_dict(
        {"model": {"tiny": {}}, "algorithm": {"correction": "none"}, "buffer": {"max_staleness": 2}}
    )
    (warning,) = config_warnings(config)
    assert "algorithm.correction=none" in warning
    assert "buffer.max_staleness=2" in warning
    assert "on-policy" in warning and "collapse" in warning
    assert "algorithm.correction=tis" in warning


def test_no_warning_when_corrected_or_on_policy():
    on_policy = config_from_dict(
        {"model": {"tiny": {}}, "algorithm": {"correction": "none"}, "buffer": {"max_staleness": 0}}
    )
    assert config_warnings(on_policy) == []
    for correction in ("tis", "mis", "decoupled"):
        config = config_from_dict(
            {
                "model": {"tiny": {}},
                "algorithm": {"correction": correction},
                "buffer": {"max_staleness": 4},
            }
        )
        assert config_warnings(config) == [], correction


def test_the_quickstart_config_gets_no_warning_but_an_override_to_none_does():
    quickstart = Path(__file__).resolve().parents[3] / "configs" / "quickstart.yaml"
    assert config_warnings(load_config(quickstart)) == []
    overridden = load_config(quickstart, ["algorithm.correction=none"])
    assert len(config_warnings(overridden)) == 1
