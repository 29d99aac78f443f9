"""The in-reward KL coefficient over training: fixed, or steered toward a target KL
(Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", as verl's
``AdaptiveKLController``).

The learner uses a controller's :attr:`value` as ``kl_coef`` for one batch's rewards,
then calls :meth:`update` with that batch's KL (:func:`batch_kl`) and its sample count.
``state_dict`` / ``load_state_dict`` are plain dicts, so the coefficient resumes with
the run.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor

ERROR_CLIP = 0.2
"""The proportional error ``kl / target - 1`` is clipped to +-0.2 (verl, Ziegler et al.)."""


class FixedKLController:
    """The coefficient stays at its configured value."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_samples: int) -> None:
        """Nothing to steer."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keeps the configured value: a resumed run with a new ``kl_coef`` uses the new one."""


class AdaptiveKLController:
    """Proportional controller: ``value *= 1 + clip(kl / target - 1, +-0.2) * n / horizon``.

    A KL above the target raises the coefficient, below it lowers it; ``horizon`` (in
    samples) sets how fast: after ``horizon`` samples at a 20% error the coefficient has
    moved by about ``e^0.2``.
    """

    def __init__(self, kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be positive")
        self.value = float(kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_samples: int) -> None:
        """Steer after a batch of ``n_samples`` samples whose KL was ``current_kl``."""
        error = min(max(current_kl / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
        self.value *= 1.0 + error * n_samples / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kind: str, *, kl_coef: float, target: float = 0.1, horizon: float = 10000.0
) -> KLController:
    """``fixed`` or ``adaptive`` (``algorithm.kl_controller``), starting at ``kl_coef``."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; expected one of: fixed, adaptive")


def batch_kl(kl: Tensor, mask: Tensor) -> float:
    """The batch's KL as the controller reads it: each row's mean over its valid tokens,
    averaged over all rows (a row with no valid token counts as 0), as verl's
    ``apply_kl_penalty``."""
    mask = mask.bool()
    kl = torch.where(mask, kl.detach().float(), torch.zeros_like(kl, dtype=torch.float32))
    per_row = kl.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_row.mean().item() if per_row.numel() else 0.0
