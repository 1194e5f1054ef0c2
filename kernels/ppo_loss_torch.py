"""Torch backend of the fused PPO-clip loss: one elementwise pass over [bs, T] producing per-row sums and the
per-token gradient coefficient (see ppo_loss.row_pass_contract for what is returned)."""
from __future__ import annotations

from typing import Optional

import torch


def row_pass(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
             response_mask: torch.Tensor, rollout_is_weights: Optional[torch.Tensor], clip_ratio_low: float,
             clip_ratio_high: float, clip_ratio_c: float, need_grad: bool, nan_safe_loss_sum: bool
             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    acc = torch.promote_types(log_prob.dtype, torch.float32)
    old, lp, adv = old_log_prob.to(acc), log_prob.to(acc), advantages.to(acc)
    mask = response_mask.to(acc)
    valid = mask != 0

    log_ratio_raw = lp - old
    log_ratio = log_ratio_raw.clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    ratio_clipped = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_clipped = -adv * ratio_clipped
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -adv * clip_ratio_c
    negative = adv < 0
    loss = torch.where(negative, torch.minimum(loss_dual_bound, loss_ppo), loss_ppo)
    token_weight = torch.where(valid, mask, torch.zeros_like(mask))  # masked_sum's where(m != 0) · m
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights.to(acc)

    def row_sum(values: torch.Tensor) -> torch.Tensor:
        return (torch.where(valid, values.to(acc), torch.zeros_like(mask)) * mask).sum(dim=1)

    stats = torch.stack([
        row_sum(loss) if nan_safe_loss_sum else (loss * mask).sum(dim=1),
        mask.sum(dim=1),
        row_sum(loss_clipped > loss_unclipped),
        row_sum(-log_ratio),
        row_sum((loss_ppo > loss_dual_bound) & negative),
    ])
    if not need_grad:
        return stats, None

    # d loss / d log_prob, with torch's tie rules (max/min split the gradient evenly; clamp passes it at the bounds)
    d_unclipped = -adv * ratio
    in_clip = (ratio >= 1.0 - clip_ratio_low) & (ratio <= 1.0 + clip_ratio_high)
    d_clipped = torch.where(in_clip, d_unclipped, torch.zeros_like(d_unclipped))
    d_ppo = torch.where(loss_unclipped > loss_clipped, d_unclipped,
                        torch.where(loss_unclipped < loss_clipped, d_clipped, 0.5 * (d_unclipped + d_clipped)))
    d_dual = torch.where(loss_ppo < loss_dual_bound, d_ppo,
                         torch.where(loss_ppo > loss_dual_bound, torch.zeros_like(d_ppo), 0.5 * d_ppo))
    grad = torch.where(negative, d_dual, d_ppo)
    grad = torch.where((log_ratio_raw >= -20.0) & (log_ratio_raw <= 20.0), grad, torch.zeros_like(grad))
    if rollout_is_weights is not None:
        grad = grad * rollout_is_weights.to(acc)
    return stats, grad * token_weight
