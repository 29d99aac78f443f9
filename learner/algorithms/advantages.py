"""Advantage estimators, registered in :data:`~.registry.ADVANTAGES` with their configs.

Outcome methods (``grpo``, ``dr_grpo``, ``rloo``, ``grpo_passk``) map ``rewards [B],
group_ids [B] -> [B]`` (one advantage per sample); token methods (``reinforce_pp``,
``reinforce_pp_baseline``, ``gae``) map per-token rewards to ``[B, T]``.
:func:`compute_advantages` is the uniform entry point: it gives each estimator what its
registry entry says it needs (and ``group_ids`` to a token method that takes them), and
broadcasts per-sample advantages to tokens. The formulas are verl's (``core_algos.py``);
where they differ on purpose, the docstring says so.
"""

from __future__ import annotations

import inspect

import torch

from asyncrl.config.algorithm import (
    DrGrpoConfig,
    GaeConfig,
    GrpoConfig,
    GrpoPasskConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    RlooConfig,
)
from asyncrl.learner.algorithms.masked import WHITEN_EPS, masked_whiten
from asyncrl.learner.algorithms.registry import ADVANTAGES, register_advantage

Tensor = torch.Tensor


# --------------------------------------------------------------------------
# advantages: outcome methods, one value per sample


def _group_members(group_ids: Tensor) -> list[Tensor]:
    """Boolean member masks, one per distinct group id (in sorted id order)."""
    return [group_ids == group for group in group_ids.unique()]


@register_advantage("grpo", config=GrpoConfig, per_sample=True)
def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Reward minus its group's mean, divided by ``std + eps`` if asked.  [B] -> [B]

    GRPO's baseline is the other answers to the same prompt. As verl: the std is the
    unbiased one (Bessel, ``n - 1``), ``(r - mean) / (std + 1e-6)``. A group whose
    rewards are all equal gets exactly 0 (verl: its mean's rounding error over ``eps``,
    which can be a fake advantage of 0.03). A group of one also gets 0: it says nothing
    about which answer was better. This is a deliberate deviation: verl gives a lone
    sample its raw reward (baseline 0, std 1).
    """
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for members in _group_members(group_ids):
        group = rewards[members]
        if group.numel() < 2 or bool(group.max() == group.min()):
            continue
        centered = group - group.mean()
        if normalize_std:
            centered = centered / (group.std(unbiased=True) + eps)
        advantages[members] = centered
    return advantages


@register_advantage("dr_grpo", config=DrGrpoConfig, per_sample=True)
def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO: reward minus its group's mean, never divided by the std.  [B] -> [B]

    Dividing by the std up-weights prompts that are nearly always solved or
    nearly always failed; Dr. GRPO drops it (pair it with the
    ``seq-mean-token-sum-norm`` aggregation to also drop the length bias).
    """
    return grpo_advantages(rewards, group_ids, normalize_std=False)


@register_advantage("rloo", config=RlooConfig, per_sample=True)
def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO: reward minus the mean of the *other* samples of its group.  [B] -> [B]

    A leave-one-out baseline is independent of the sample itself, so the
    estimate is unbiased. With n samples, ``r_i - (S - r_i)/(n - 1)`` which is
    ``n/(n-1)`` times the group-centred reward. A group of one (no other
    sample) or of equal rewards gets 0.
    """
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for members in _group_members(group_ids):
        group = rewards[members]
        n = group.numel()
        if n < 2 or bool(group.max() == group.min()):
            continue
        advantages[members] = group - (group.sum() - group) / (n - 1)
    return advantages


@register_advantage("grpo_passk", config=GrpoPasskConfig, per_sample=True)
def grpo_passk_advantages(
    rewards: Tensor, group_ids: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Pass@k: only each group's best sample learns, from ``best - second best``.  [B] -> [B]

    verl's ``grpo_passk`` (after arXiv 2503.19595): the gap is divided by the group's
    unbiased std plus ``eps`` when ``normalize_std``; every other sample gets 0. A tie at
    the top gives 0. A group of one gets 0 (verl raises; the config asks for
    ``group_size >= 2``).
    """
    rewards = rewards.float()
    advantages = torch.zeros_like(rewards)
    for members in _group_members(group_ids):
        (indices,) = members.nonzero(as_tuple=True)
        group = rewards[indices]
        if group.numel() < 2:
            continue
        best = group.topk(2)
        gap = best.values[0] - best.values[1]
        if normalize_std:
            gap = gap / (group.std(unbiased=True) + eps)
        advantages[indices[best.indices[0]]] = gap
    return advantages


# --------------------------------------------------------------------------
# advantages: token methods


def token_level_rewards(
    rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Per-token rewards: the outcome reward on the last valid token, minus ``kl_coef * kl``.

    rewards [B], mask [B, T], kl [B, T] (e.g. :func:`kl_estimate` against the
    reference, detached) -> [B, T], 0 where masked. This is "KL in the
    reward": each valid token pays ``kl_coef * kl_t``. A row with no valid
    token has nowhere to put its reward and is all zeros.
    """
    mask = mask.bool()
    B, T = mask.shape
    positions = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(-1)  # [B]
    has_token = last >= 0
    out = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    rows = torch.arange(B, device=mask.device)[has_token]
    out[rows, last[has_token]] = rewards.float().to(mask.device)[has_token]
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * torch.where(mask, kl.float(), torch.zeros_like(out))
    return out


def _discounted_reverse_cumsum(values: Tensor, mask: Tensor, discount: float) -> Tensor:
    """``out_t = x_t + discount * out_next`` over the valid tokens of each row.

    Masked positions are transparent: they add nothing and do not count as a
    step for the discount. The value after a row's last valid token is 0
    (terminal). 0 where masked.
    """
    mask = mask.bool()
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    if discount == 1.0:
        out = values.flip(-1).cumsum(-1).flip(-1)
        return torch.where(mask, out, torch.zeros_like(out))
    out = torch.zeros_like(values)
    running = values.new_zeros(values.shape[0])
    for t in range(values.shape[1] - 1, -1, -1):
        running = torch.where(mask[:, t], values[:, t] + discount * running, running)
        out[:, t] = running
    return torch.where(mask, out, torch.zeros_like(out))


@register_advantage("reinforce_pp", config=ReinforcePPConfig, needs_token_rewards=True)
def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, eps: float = WHITEN_EPS
) -> Tensor:
    """REINFORCE++: discounted return-to-go, whitened over the batch's valid tokens.  [B, T]

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over valid tokens (the per-token
    rewards carry the KL penalty when it is in the reward), then
    ``(G - mean) / sqrt(var + eps)`` over all valid tokens of the batch (unbiased
    variance, :func:`~.masked.masked_whiten`, as verl): a global baseline instead of a
    critic or a group. A masked position inside a row (a tool's output) is skipped, not
    a stop: verl resets the return there, so a final reward would never reach the
    tokens before a tool call.
    """
    returns = _discounted_reverse_cumsum(token_rewards, mask, gamma)
    return masked_whiten(returns, mask, eps)


@register_advantage("reinforce_pp_baseline", config=ReinforcePPBaselineConfig)
def reinforce_pp_baseline_advantages(
    token_rewards: Tensor, mask: Tensor, group_ids: Tensor, eps: float = WHITEN_EPS
) -> Tensor:
    """REINFORCE++-baseline: the sample's score minus its group's mean, on every valid
    token, then whitened over the batch's valid tokens.  [B, T]

    verl's ``reinforce_plus_plus_baseline`` (arXiv 2501.03262): the score is the row sum
    of ``token_rewards`` (the outcome, minus a KL in the reward); whitening is
    :func:`~.masked.masked_whiten`, so a long answer weighs more in the batch's mean and
    variance. A group of one, or of equal scores, is centred to exactly 0 (verl keeps a
    lone sample's raw score).
    """
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    scores = torch.where(mask, token_rewards.float(), zeros).sum(-1)
    centered = grpo_advantages(scores, group_ids, normalize_std=False)
    return masked_whiten(torch.where(mask, centered.unsqueeze(-1), zeros), mask, eps)


@register_advantage("gae", config=GaeConfig, needs_values=True, needs_token_rewards=True)
def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    eps: float = WHITEN_EPS,
) -> tuple[Tensor, Tensor]:
    """PPO with a critic: GAE(gamma, lambda) over the valid tokens.  -> (advantages, returns)

    ``delta_t = r_t + gamma V_next - V_t`` with ``V_next`` the value at the
    next *valid* token (0 after the last one: the episode ends there, also
    when it was cut at the length limit), ``A_t = delta_t + gamma lam A_next``.
    The value-head targets are ``returns = A + V`` (before whitening). As PPO
    implementations do, the advantages are then whitened over the valid
    tokens of the batch (:func:`~.masked.masked_whiten`, as verl) — so call this on the
    whole batch, not per micro-batch.
    """
    mask = mask.bool()
    values = torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32))
    B, T = mask.shape
    # index of the next valid token after t (T when none): reverse running minimum
    positions = torch.arange(T, device=mask.device).expand(B, T)
    valid_at = torch.where(mask, positions, torch.full_like(positions, T))
    after = torch.cat([valid_at[:, 1:], valid_at.new_full((B, 1), T)], dim=1)
    next_valid = after.flip(-1).cummin(-1).values.flip(-1)  # [B, T]
    padded = torch.cat([values, values.new_zeros(B, 1)], dim=1)  # value T is terminal: 0
    next_values = padded.gather(1, next_valid)
    deltas = token_rewards.float() + gamma * next_values - values
    advantages = _discounted_reverse_cumsum(deltas, mask, gamma * lam)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return masked_whiten(advantages, mask, eps), returns


def compute_advantages(
    name: str,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    **knobs: float | bool,
) -> tuple[Tensor, Tensor | None]:
    """Per-token advantages of any registered estimator.  -> (advantages [B, T], returns)

    rewards [B] (scalar outcome), group_ids [B] (samples of one prompt share
    an id), mask [B, T]. ``token_rewards`` [B, T] (see
    :func:`token_level_rewards`), when given, replaces the scalar rewards:
    per-sample estimators then use its masked row sum as the sample's reward.
    ``values`` [B, T] (the critic, old values) is required by an estimator that
    ``needs_values`` (``gae``). ``knobs`` are the estimators' config keys
    (``normalize_std``, ``gamma``, ``lam``, ...); each estimator takes its own and
    ignores the rest.

    A token method whose function takes ``group_ids`` (``reinforce_pp_baseline``) gets
    them. Per-sample estimators broadcast the sample's advantage to all its tokens.
    ``returns`` are the value-head targets of an estimator that needs values,
    ``None`` otherwise. Advantages are 0 where ``mask`` is 0. Whitening
    (``reinforce_pp``, ``reinforce_pp_baseline``, ``gae``) is over the whole input, so
    pass the whole batch.
    """
    estimator = ADVANTAGES[name]
    own = {knob: value for knob, value in knobs.items() if knob in estimator.knobs}
    mask = mask.bool()
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if estimator.per_sample:
        if token_rewards is not None:
            rewards = torch.where(mask, token_rewards.float(), zeros).sum(-1)
        per_sample = estimator.fn(rewards=rewards, group_ids=group_ids, **own)
        return torch.where(mask, per_sample.float().unsqueeze(-1).expand_as(zeros), zeros), None
    if token_rewards is None:
        token_rewards = token_level_rewards(rewards, mask)
    tensors = {"token_rewards": token_rewards, "mask": mask}
    if "group_ids" in inspect.signature(estimator.fn).parameters:
        tensors["group_ids"] = group_ids
    if not estimator.needs_values:
        return estimator.fn(**tensors, **own), None
    if values is None:
        raise ValueError(f"advantage {name!r} needs the critic's values [B, T]")
    return estimator.fn(values=values, **tensors, **own)
