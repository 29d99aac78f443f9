"""The RL math and whole learner steps give the same bits as when the fixture was captured.

The expected tensors in ``fixtures/algorithm_golden.pt`` are golden values captured on
purpose (see ``fixtures/make_algorithm_golden.py`` for when and how, and what each
recapture changed), not computed by the code under test: every advantage estimator,
``policy_loss`` for each correction x level x aggregation x dual clip (with and without
global normalizers) and each other surrogate, the value loss, every KL estimator (values
and gradients), and two ``Learner.train_step`` calls of the tiny model for ten algorithm
configs (every metric, losses and gradient norm included, and every weight afterwards).

Bits depend on the CPU kernels and the torch build as well as on the code, so where the
platform differs from the recording the comparison falls back to float tolerances.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent / "fixtures"
_spec = importlib.util.spec_from_file_location(
    "make_algorithm_golden", HERE / "make_algorithm_golden.py"
)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

GOLDEN = torch.load(cases.FIXTURE, weights_only=True)
SAME_PLATFORM = GOLDEN["platform"] == cases.platform_tag()
WEIGHT_RTOL = 1e-4
"""Off the recording's platform, how far a weight's sums may move, as a share of its
absolute sum (two AdamW steps round differently with other CPU kernels)."""


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same keys, and each tensor equal to the last bit (NaN and -0.0 included)."""
    assert sorted(got) == sorted(expected)
    differ = []
    for key, want in expected.items():
        have = got[key]
        if have.dtype != want.dtype or have.shape != want.shape:
            differ.append(
                f"{key}: {have.dtype}{tuple(have.shape)} != {want.dtype}{tuple(want.shape)}"
            )
        elif SAME_PLATFORM:
            if not torch.equal(_bits(have), _bits(want)):
                differ.append(f"{key}: max |diff| {(have.double() - want.double()).abs().max()}")
        elif key.endswith("/sha256"):
            continue  # bytes of another platform's weights: the sums stand in for them
        elif key.startswith("weights/"):
            # A weight's signed sum cancels, so its rounding is relative to the weight's
            # mass (its absolute sum), not to the sum itself: on an AVX2 CPU against the
            # AVX-512 recording, sums of 0.03 moved by 1e-5 where the mass was 0.3-50.
            mass = expected[key.rsplit("/", 1)[0] + "/abs_sum"].double()
            if (have.double() - want.double()).abs() > WEIGHT_RTOL * mass:
                differ.append(f"{key}: |diff| {(have.double() - want.double()).abs():.3g}")
        elif not torch.allclose(have.double(), want.double(), rtol=1e-5, atol=1e-6, equal_nan=True):
            differ.append(key)
    assert not differ, f"{len(differ)} of {len(expected)} differ: " + "; ".join(differ[:10])


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits: unlike ``==``, NaN equals itself and -0.0 differs from 0.0."""
    if tensor.is_floating_point():
        return tensor.contiguous().view(
            {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        )
    return tensor


def test_the_fixture_holds_every_estimator_correction_aggregation_and_kl_estimator():
    from asyncrl.learner.algorithms import (
        ADVANTAGES,
        AGGREGATIONS,
        CORRECTIONS,
        KL_ESTIMATORS,
        POLICY_LOSSES,
    )

    assert set(cases.ADVANTAGE_NAMES) == set(ADVANTAGES)
    assert set(cases.CORRECTION_NAMES) == set(CORRECTIONS)
    assert set(cases.AGGREGATION_NAMES) == set(AGGREGATIONS)
    assert set(cases.KL_NAMES) == set(KL_ESTIMATORS)
    assert set(cases.LOSS_NAMES) == set(POLICY_LOSSES)
    keys = GOLDEN["math"]
    for name in cases.LOSS_NAMES[1:]:
        assert any(key.startswith(f"surrogate/{name}/") for key in keys)
    for name in cases.ADVANTAGE_NAMES:
        assert any(key.startswith(f"advantage/{name}/") for key in keys)
    for correction in cases.CORRECTION_NAMES:
        for aggregation in cases.AGGREGATION_NAMES:
            assert any(
                key.startswith(f"policy_loss/{correction}/sequence/{aggregation}/") for key in keys
            )
    for estimator in cases.KL_NAMES:
        assert f"kl/{estimator}/grad" in keys


def test_advantages_losses_and_kl_estimates_are_bit_identical_to_the_golden_values():
    assert_same(cases.compute_math(), GOLDEN["math"])


@pytest.mark.parametrize("case", sorted(cases.UPDATE_CASES))
def test_two_learner_steps_give_the_golden_metrics_and_weights(ranks, case):
    torch.set_num_threads(1)
    got = cases.update_results(cases.UPDATE_CASES[case], ranks)
    expected = GOLDEN["update"][case]
    assert "step0/loss_policy" in expected and "step1/learner_grad_norm" in expected
    assert_same(got, expected)
