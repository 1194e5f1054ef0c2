"""Optimal Token Baseline advantage estimators (veRL 0.9.1 "optimal_token_baseline" and
"tir_optimal_token_baseline").

Instead of one baseline per response, each time step t of a prompt group gets
`B_t = sum_j G_jt W_jt / (sum_j W_jt + eps)`, where G is the reward-to-go and
`W_t = sum_{s <= t} w_s` a cumulative path-variance proxy with `w_s = 1 - 2 pi_s + sum_v pi_v^2` (pi_s = the
probability of the sampled token at rollout time, `sum_pi_squared` = sum over the vocabulary of pi^2), scaled by
the squared rollout IS weight when one is given. `advantages = (G - B) * mask`, `returns = G`.
"""
from __future__ import annotations

import torch

from .adv_group import GroupIndex, group_rows
from .adv_registry import register_adv_est

__all__ = ["compute_optimal_token_baseline_advantage", "compute_multi_turn_optimal_token_baseline_advantage"]


def _returns_and_path_weights(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    w = 1 - 2 * torch.exp(old_log_probs) + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * (rollout_is_weights**2)  # minimises the baseline's MSE under truncated IS
    return returns, (w * response_mask).cumsum(dim=-1)


def _zero_unique_longest_tail(baselines: torch.Tensor, rows: list[int], lengths: torch.Tensor) -> None:
    """Zero the baseline of the group's longest response beyond the second-longest length, when exactly one
    response is the longest (no other response estimates the baseline there)."""
    sorted_lengths, _ = torch.sort(lengths)
    longest, second = int(sorted_lengths[-1].item()), int(sorted_lengths[-2].item())
    longest_at = (lengths == longest).nonzero(as_tuple=True)[0]
    if longest_at.numel() == 1 and longest > second:
        baselines[rows[int(longest_at[0])], second:] = 0.0


@register_adv_est("optimal_token_baseline", needs=("index", "old_log_probs", "sum_pi_squared"),
                  optional=("rollout_is_weights",))
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-time-step optimal baseline over each prompt group, time steps aligned by position t (masked positions
    are left out of both sums). A singleton group has no baseline (advantage = return). With `handle_zero_tail`,
    a unique longest response gets baseline 0 beyond the second-longest length."""
    with torch.no_grad():
        returns, w_cum = _returns_and_path_weights(
            token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
        )
        baselines = torch.zeros_like(returns)
        for rows in group_rows(index, returns.shape[0]).values():
            if len(rows) == 1:
                continue
            rows_t = torch.tensor(rows, device=returns.device)
            g_returns, g_w, g_mask = returns[rows_t], w_cum[rows_t], response_mask[rows_t]
            numerator = (g_returns * g_w * g_mask).sum(dim=0)
            denominator = (g_w * g_mask).sum(dim=0) + epsilon
            baselines[rows_t] = (numerator / denominator).unsqueeze(0).expand(len(rows), -1)
            if handle_zero_tail:
                _zero_unique_longest_tail(baselines, rows, g_mask.sum(dim=-1))
        advantages = (returns - baselines) * response_mask
    return advantages, returns


@register_adv_est("tir_optimal_token_baseline", needs=("index", "old_log_probs", "sum_pi_squared"),
                  optional=("rollout_is_weights",))
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn (tool-interleaved) variant: the valid tokens of each response are first left-compacted (tool
    output spans removed), so step k means "the k-th generated token" in every response of the group; baselines
    are computed on that layout and scattered back. Responses without valid tokens are left out of the groups."""
    with torch.no_grad():
        returns, w_cum = _returns_and_path_weights(
            token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights
        )
        lengths = response_mask.sum(dim=-1).to(dtype=torch.long)
        max_length = int(lengths.max().item()) if lengths.numel() > 0 else 0
        compact_w = w_cum.new_zeros((len(lengths), max_length))
        compact_returns = torch.zeros_like(compact_w)
        valid = response_mask.bool()
        for i in range(len(lengths)):
            n = int(lengths[i].item())
            if n:
                compact_w[i, :n] = w_cum[i, valid[i]]
                compact_returns[i, :n] = returns[i, valid[i]]

        non_empty = [i for i in range(len(lengths)) if lengths[i] != 0]
        ids = index.reshape(-1).tolist() if isinstance(index, torch.Tensor) else index
        if len(ids) != len(lengths):
            raise ValueError(f"index has {len(ids)} group ids but the batch has {len(lengths)} rows.")
        groups: dict = {}
        for i in non_empty:
            groups.setdefault(ids[i], []).append(i)

        baselines = torch.zeros_like(compact_returns)
        for rows in groups.values():
            if len(rows) == 1:
                continue
            rows_t = torch.tensor(rows, device=compact_returns.device)
            g_w, g_returns = compact_w[rows_t], compact_returns[rows_t]
            b_star = (g_returns * g_w).sum(dim=0) / (g_w.sum(dim=0) + epsilon)
            baselines[rows_t] = b_star.to(baselines.dtype)
            if handle_zero_tail:
                _zero_unique_longest_tail(baselines, rows, lengths[rows_t])

        compact_adv = compact_returns - baselines
        advantages = torch.zeros_like(returns)
        for i in non_empty:
            advantages[i, valid[i]] = compact_adv[i, : lengths[i]]
        advantages = advantages * response_mask
    return advantages, returns
