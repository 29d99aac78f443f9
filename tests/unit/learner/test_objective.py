"""The learner's objective (``learner/objective.py``): the knobs each loss takes from the
algorithm section through its registry entry, and one micro-batch's loss assembled from
the policy, value, KL and entropy terms with the config's weights, bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asyncrl.config import config_from_dict
from asyncrl.learner.algorithms import (
    CORRECTIONS,
    POLICY_LOSSES,
    aggregate,
    kl_estimate,
    policy_loss,
    value_loss,
)
from asyncrl.learner.objective import Normalizers, Objective, Tokens

torch.set_num_threads(1)


def _algorithm(**keys):
    return config_from_dict({"model": {"tiny": {}}, "algorithm": keys}).algorithm


@pytest.mark.parametrize(
    ("loss", "keys", "expected"),
    [
        ("ppo", {"clip_c": 3.0}, {"clip_low": 0.2, "clip_high": 0.2, "clip_c": 3.0}),
        ("gspo", {"clip_high": 0.3}, {"clip_low": 0.2, "clip_high": 0.3}),
        ("sapo", {"sapo_tau_pos": 2.0}, {"sapo_tau_pos": 2.0, "sapo_tau_neg": 1.05}),
        ("reinforce", {}, {}),
    ],
)
def test_each_policy_loss_takes_only_its_own_knobs_from_the_section(loss, keys, expected):
    algorithm = _algorithm(policy_loss=loss, **keys)
    assert POLICY_LOSSES[loss].knobs_of(algorithm) == expected
    assert Objective(algorithm).policy_knobs == {
        "loss": loss,
        **expected,
        "correction": "tis",
        **CORRECTIONS["tis"].knobs_of(algorithm),
    }


def test_a_correction_takes_its_level_cap_and_floor_from_the_section():
    algorithm = _algorithm(correction="icepop", correction_level="geometric", correction_floor=0.3)
    assert CORRECTIONS["icepop"].knobs_of(algorithm) == {
        "correction_level": "geometric",
        "correction_cap": 2.0,
        "correction_floor": 0.3,
    }


def _tokens() -> Tokens:
    g = torch.Generator().manual_seed(7)
    B, T = 3, 5
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    logprobs = (-torch.rand(B, T, generator=g) * 2).requires_grad_(True)
    proximal = logprobs.detach() + 0.2 * torch.randn(B, T, generator=g)
    return Tokens(
        logprobs=logprobs,
        entropy=torch.rand(B, T, generator=g).requires_grad_(True),
        values=torch.randn(B, T, generator=g).requires_grad_(True),
        behavior=proximal + 0.3 * torch.randn(B, T, generator=g),
        proximal=proximal,
        advantages=torch.randn(B, T, generator=g),
        mask=mask,
        current=torch.rand(B, T, generator=g) > 0.5,
        reference=logprobs.detach() + 0.4 * torch.randn(B, T, generator=g),
        old_values=torch.randn(B, T, generator=g),
        returns=torch.randn(B, T, generator=g),
    )


def test_the_loss_is_the_policy_term_plus_the_weighted_value_kl_and_entropy_terms():
    algorithm = _algorithm(
        advantage="gae",
        policy_loss="ppo",
        clip_c=3.0,
        correction="mis",
        aggregation="seq-mean-token-mean",
        kl_coef=0.05,
        kl_estimator="k2",
        entropy_coef=0.01,
        value_coef=0.7,
    )
    tokens = _tokens()
    counts = {"num_tokens": 40.0, "num_sequences": 6.0, "norm_length": 5}
    evaluation = Objective(algorithm)(tokens, Normalizers(**counts), weight_scale=1.5)

    agg = {"mode": "seq-mean-token-mean", **counts}
    policy, _ = policy_loss(
        tokens.logprobs,
        tokens.proximal,
        tokens.behavior,
        tokens.advantages,
        tokens.mask,
        clip_c=3.0,
        correction="mis",
        weight_scale=1.5,
        aggregation="seq-mean-token-mean",
        **counts,
    )
    value, _ = value_loss(
        tokens.values,
        tokens.old_values,
        tokens.returns,
        tokens.mask,
        clip=0.2,
        aggregation="seq-mean-token-mean",
        **counts,
    )
    kl = aggregate(kl_estimate(tokens.logprobs, tokens.reference, "k2"), tokens.mask, **agg)
    entropy = aggregate(tokens.entropy, tokens.mask, **agg)
    expected = policy + 0.7 * value + 0.05 * kl - 0.01 * entropy
    assert torch.equal(evaluation.loss, expected)
    stats = evaluation.stats()
    assert stats["loss_policy"].value == policy.item()
    assert stats["loss_value"].value == value.item()
    assert stats["learner_kl"].value == kl.item()
    assert {"learner_entropy", "logprob_mismatch", "offpolicy_kl_k3"} <= set(stats)


def test_a_kl_in_the_reward_is_reported_but_not_in_the_loss():
    algorithm = _algorithm(kl_coef=0.05, kl_in="reward")
    tokens = replace(_tokens(), values=None, old_values=None, returns=None)  # no value head
    counts = {"num_tokens": 40.0, "num_sequences": 6.0, "norm_length": 5}
    evaluation = Objective(algorithm)(tokens, Normalizers(**counts))
    policy, _ = policy_loss(
        tokens.logprobs, tokens.proximal, tokens.behavior, tokens.advantages, tokens.mask, **counts
    )
    assert torch.equal(evaluation.loss, policy)
    assert "learner_kl" in evaluation.terms and "loss_value" not in evaluation.terms
