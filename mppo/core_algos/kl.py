"""KL estimators, KL coefficient controllers and the in-reward KL penalty (veRL 0.9.1 semantics).

Estimators follow J. Schulman, "Approximating KL divergence" (http://joschu.net/blog/kl-approx.html), with
`d = logprob - ref_logprob`: k1 = d, k2 = d^2/2, k3 = exp(-d) + d - 1 (clamped).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .masked import masked_mean

__all__ = [
    "KL_PENALTY_TYPES",
    "KL_CONTROLLER_TYPES",
    "UnknownKLPenaltyError",
    "kl_penalty",
    "compute_rewards",
    "FixedKLController",
    "AdaptiveKLController",
    "get_kl_controller",
    "apply_kl_penalty",
]

_BASE_KL_TYPES: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# "X+" = forward value of X, gradient of k2 (straight-through). "full" is a veRL name that is not implemented.
KL_PENALTY_TYPES: tuple[str, ...] = _BASE_KL_TYPES + tuple(name + "+" for name in _BASE_KL_TYPES)
KL_CONTROLLER_TYPES: tuple[str, ...] = ("fixed", "adaptive")


class UnknownKLPenaltyError(ValueError, NotImplementedError):
    """An unknown KL estimator name. A ValueError for callers validating input, and a NotImplementedError like
    veRL raises for the same input."""


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):
        # Both clamps are veRL's, for numerical stability: the log-ratio to +-20, the estimate to +-10.
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, min=-10, max=10)
    if name == "full":
        raise NotImplementedError(
            "kl_penalty 'full' (exact KL over the whole vocabulary) is not implemented, as in veRL; "
            f"use one of {list(KL_PENALTY_TYPES)}."
        )
    raise UnknownKLPenaltyError(f"Unknown kl_penalty {name!r}; valid names are {list(KL_PENALTY_TYPES)}.")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Elementwise KL estimate between the policy and the reference; **not masked**.

    Names: "kl"/"k1" (d), "abs" (|d|), "mse"/"k2" (d^2/2), "low_var_kl"/"k3" (clamped k3), d = logprob - ref.
    A "+" suffix (e.g. "k3+") keeps the forward value of the base estimator but takes the gradient of k2
    (straight-through `k2 - sg(k2) + sg(forward)`), so d/d logprob = logprob - ref_logprob. The value is
    unchanged by "+" (veRL quirk: only the gradient differs).
    Raises NotImplementedError for "full" and UnknownKLPenaltyError (a ValueError) for unknown names.
    """
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    forward = _kl_forward(logprob, ref_logprob, base)
    if not straight_through or base in ("mse", "k2"):
        return forward
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + forward.detach()


_kl_estimate = kl_penalty  # `apply_kl_penalty` has an argument named `kl_penalty` that shadows the function


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """`scores - (old_log_prob - ref_log_prob) * kl_ratio` (unmasked k1 penalty; veRL's `compute_rewards`)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


class FixedKLController:
    """A constant KL coefficient: `update` is a no-op."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (the coefficient stays fixed)."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    `update(current_kl, n_steps)`: `e = clip(current_kl / target_kl - 1, -0.2, 0.2)`,
    `value *= 1 + e * n_steps / horizon`.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}.")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
        self.value = float(self.value * (1 + proportional_error * n_steps / self.horizon))

    def state_dict(self) -> dict[str, Any]:
        """The coefficient (and the settings it evolved under) so a resumed run continues from it."""
        return {"value": float(self.value), "target": float(self.target), "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


KLController = FixedKLController | AdaptiveKLController


def get_kl_controller(type: str, kl_coef: float, target_kl: float = 0.1, horizon: float = 10000) -> KLController:
    """Build the controller named by `algorithm.kl_ctrl.type` ("fixed" or "adaptive"); defaults as veRL's AlgoConfig."""
    if type == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(init_kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
    raise ValueError(f"Unknown kl_ctrl.type {type!r}; valid types are {list(KL_CONTROLLER_TYPES)}.")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: KLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract the in-reward KL penalty (`algorithm.use_kl_in_reward`) and step the KL controller.

    `kld = kl_penalty(old_log_probs, ref_log_prob) * mask`; `rewards = scores - beta * kld`, then
    `current_kl = mean over rows of masked_mean(kld, mask, axis=-1)` and `kl_ctrl.update(current_kl, n_steps=bs)`.

    veRL quirks kept: `beta` is the controller value *before* this step's update; `n_steps` is the number of
    rows; `current_kl` is a mean of per-row means, so rows without valid tokens count as 0 in it.
    Returns the rewards and metrics `actor/reward_kl_penalty` (current_kl) and `actor/reward_kl_penalty_coeff`
    (beta), as python floats.
    """
    kld = _kl_estimate(old_log_probs, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kld
    current_kl = torch.mean(masked_mean(kld, response_mask, axis=-1), dim=0).item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": float(current_kl), "actor/reward_kl_penalty_coeff": float(beta)}
    return token_level_rewards, metrics

