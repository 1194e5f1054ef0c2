"""Advantage estimators that work row by row over tokens: GAE, REINFORCE++ and ReMax (veRL 0.9.1 semantics).

All run under `no_grad` and keep veRL's operation order, so results are bit-equal for the same inputs.
"""
from __future__ import annotations

import torch

from .adv_registry import register_adv_est
from .masked import masked_whiten

__all__ = [
    "compute_gae_advantage_return",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
]


def _numeric_mask(response_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A bool mask as a 0/1 mask of `like`'s dtype. veRL's scans compute `1 - m`, which torch refuses for bool, so
    veRL only runs them with numeric masks; a bool mask here gives what the same-dtype float mask gives in veRL
    (integer masks are kept: their float32 `mask.sum() + 1e-8` in the whitening is part of veRL's numerics)."""
    return response_mask.to(like.dtype) if response_mask.dtype == torch.bool else response_mask


@register_adv_est("gae", needs=("values",), params=("gamma", "lam"))
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (https://arxiv.org/abs/1506.02438), scanning t = T-1 .. 0:

        delta_t = r_t + gamma * V_next - V_t;   A_t = delta_t + gamma * lam * A_next

    Masked steps (m_t = 0) are skipped: they carry the later token's V_next and A_next through unchanged (no
    discount across an observation gap). Nothing is bootstrapped beyond T (the value after the last token is 0).

    veRL quirks kept: `returns = A_raw + values` is the *unwhitened* advantage plus values (also on padding);
    `advantages = masked_whiten(A_raw, mask)` is whitened batch-wide with the unbiased variance and is **not**
    re-masked, so trailing padding (A_raw = 0) gets `-mean/std`.
    """
    with torch.no_grad():
        mask = _numeric_mask(response_mask, values)
        next_values = 0
        last_gae_lam = 0
        advantages_reversed = []
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_values - values[:, t]
            gae_lam_t = delta + gamma * lam * last_gae_lam
            m_t = mask[:, t]
            next_values = values[:, t] * m_t + (1 - m_t) * next_values
            last_gae_lam = gae_lam_t * m_t + (1 - m_t) * last_gae_lam
            advantages_reversed.append(last_gae_lam)
        raw_advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = raw_advantages + values
        advantages = masked_whiten(raw_advantages, mask)
    return advantages, returns


@register_adv_est("reinforce_plus_plus", params=("gamma",))
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (https://arxiv.org/abs/2501.03262): discounted reward-to-go, whitened batch-wide.

    Reverse scan: `G = r_t + gamma * run`; `returns_t = G * m_t`; `run = G` on valid tokens and unchanged on
    masked ones (masked spans are skipped without discount). `advantages = masked_whiten(returns, m) * m`.
    veRL reads gamma from `config.gamma` (algorithm.gamma); here it is the `gamma` argument.
    """
    with torch.no_grad():
        mask = _numeric_mask(response_mask, token_level_rewards)
        returns = torch.zeros_like(token_level_rewards)
        running_return = 0
        for t in reversed(range(token_level_rewards.shape[1])):
            new_running_return = token_level_rewards[:, t] + gamma * running_return
            m_t = mask[:, t]
            returns[:, t] = new_running_return * m_t
            running_return = new_running_return * m_t + running_return * (1 - m_t)
        advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_est("remax", needs=("reward_baselines",))
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor, reward_baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (https://arxiv.org/abs/2310.10505): `returns` = undiscounted reward-to-go of `r * m`,
    `advantages = returns - reward_baselines[:, None] * m` (the greedy-rollout reward as baseline; not whitened)."""
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns
