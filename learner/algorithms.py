"""The RL math as pure tensor functions: no processes, no I/O.

Notation per token t (see DESIGN.md, "Loss with importance correction")::

    r_t = pi_theta / pi_prox                 PPO ratio
    w_t = min(pi_prox / pi_behavior, C)      behavior correction ("tis")
    L   = -mean_t[ w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) ]

``pi_behavior`` is what the generator recorded for each token; ``pi_prox`` is
the learner's policy at the start of the update. Shapes: ``[B]`` per sample,
``[B, T]`` per response token, ``mask`` 1 where a token is trained on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ADVANTAGES: dict[str, Callable[..., torch.Tensor]] = {}


def register(table: dict, name: str):
    def wrap(fn):
        table[name] = fn
        return fn

    return wrap


@register(ADVANTAGES, "grpo")
def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Reward minus its group's mean, optionally over the group's std.  [B] -> [B]

    A group of one, or a group whose rewards are all equal, gets advantage 0:
    it carries no signal about which sample was better.
    """
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    for group in group_ids.unique():
        members = group_ids == group
        group_rewards = rewards[members].float()
        centered = group_rewards - group_rewards.mean()
        if normalize_std and group_rewards.numel() > 1:
            centered = centered / (group_rewards.std(unbiased=False) + eps)
        advantages[members] = centered
    return advantages


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over tokens where ``mask`` is set; 0 when nothing is set."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    correction: str = "tis",
    correction_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with truncated behavior importance weights, token-mean.

    logprobs [B, T] (with grad), proximal/behavior [B, T], advantages [B], mask [B, T].
    Returns the loss and detached statistics.
    """
    mask = mask.bool()
    token_advantages = advantages.unsqueeze(-1).expand_as(logprobs)  # [B, T]
    ratio = torch.exp(logprobs - proximal_logprobs)  # [B, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.minimum(ratio * token_advantages, clipped * token_advantages)  # [B, T]

    raw_weight = torch.exp(proximal_logprobs - behavior_logprobs).detach()  # [B, T]
    if correction == "tis":
        weight = raw_weight.clamp(max=correction_cap)
    elif correction == "none":
        weight = torch.ones_like(raw_weight)
    else:
        raise ValueError(f"unknown correction {correction!r}; expected one of: none, tis")

    loss = -masked_mean(weight * surrogate, mask)
    with torch.no_grad():
        was_clipped = (ratio * token_advantages) > (clipped * token_advantages)
        stats = {
            "clip_frac": masked_mean(was_clipped.float(), mask),
            "importance_weight_mean": masked_mean(raw_weight, mask),
            "importance_weight_max": raw_weight[mask].max()
            if mask.any()
            else raw_weight.new_zeros(()),
            "importance_truncated_frac": masked_mean((raw_weight > correction_cap).float(), mask),
        }
    return loss, stats


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of each target token under softmax(logits / temperature).  [B, T, V] -> [B, T]"""
    logits = logits.float() / temperature
    return torch.gather(logits.log_softmax(-1), -1, targets.unsqueeze(-1)).squeeze(-1)
