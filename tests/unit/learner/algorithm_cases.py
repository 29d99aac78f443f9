"""What several of the RL math's test files share: a tolerant comparison with expected
numbers, and a small on-policy batch."""

from __future__ import annotations

import torch


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0)


def on_policy_inputs():
    """Logprobs with grad; proximal and behavior equal to them (ratio 1, weight 1)."""
    torch.manual_seed(0)
    logprobs = (-torch.rand(2, 3) - 0.1).requires_grad_(True)
    proximal = logprobs.detach().clone()
    behavior = proximal.clone()
    advantages = torch.tensor([2.0, -0.5])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return logprobs, proximal, behavior, advantages, mask
