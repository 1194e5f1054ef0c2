"""Triton backend of the fused PPO-clip loss: one program per sequence walks its tokens once, writing the row sums
and the per-token gradient coefficient (contract in ppo_loss; math identical to ppo_loss_torch, including torch's
tie rules for max/min/clamp gradients)."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_T = 256


@triton.jit
def _ppo_row_kernel(old_ptr, lp_ptr, adv_ptr, mask_ptr, isw_ptr, stats_ptr, grad_ptr,
                    B, T, clip_low, clip_high, clip_c,
                    HAS_ISW: tl.constexpr, NEED_GRAD: tl.constexpr, NAN_SAFE_LOSS_SUM: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    row = tl.program_id(0)
    row_loss = tl.zeros([BLOCK_T], dtype=tl.float32)
    row_tokens = tl.zeros([BLOCK_T], dtype=tl.float32)
    row_clipped = tl.zeros([BLOCK_T], dtype=tl.float32)
    row_neg_kl = tl.zeros([BLOCK_T], dtype=tl.float32)
    row_clipped_lower = tl.zeros([BLOCK_T], dtype=tl.float32)
    for t0 in range(0, T, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        ok = ts < T
        offs = row * T + ts
        # upcast right after loading (the interpreter keeps bf16 as raw bits)
        old = tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        lp = tl.load(lp_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        adv = tl.load(adv_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        mask = tl.load(mask_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        valid = mask != 0.0

        log_ratio_raw = lp - old
        log_ratio = tl.minimum(tl.maximum(log_ratio_raw, -20.0), 20.0)
        ratio = tl.exp(log_ratio)
        loss_unclipped = -adv * ratio
        ratio_clipped = tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
        loss_clipped = -adv * ratio_clipped
        loss_ppo = tl.maximum(loss_unclipped, loss_clipped)
        loss_dual_bound = -adv * clip_c
        negative = adv < 0.0
        loss = tl.where(negative, tl.minimum(loss_dual_bound, loss_ppo), loss_ppo)
        if HAS_ISW:
            isw = tl.load(isw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            loss = loss * isw
        if NAN_SAFE_LOSS_SUM:
            row_loss += tl.where(valid, loss, 0.0) * mask
        else:
            row_loss += loss * mask
        row_tokens += mask
        row_clipped += tl.where(valid & (loss_clipped > loss_unclipped), mask, 0.0)
        row_neg_kl += tl.where(valid, -log_ratio, 0.0) * mask
        row_clipped_lower += tl.where(valid & (loss_ppo > loss_dual_bound) & negative, mask, 0.0)

        if NEED_GRAD:
            d_unclipped = -adv * ratio
            in_clip = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
            d_clipped = tl.where(in_clip, d_unclipped, 0.0)
            d_ppo = tl.where(loss_unclipped > loss_clipped, d_unclipped,
                             tl.where(loss_unclipped < loss_clipped, d_clipped, 0.5 * (d_unclipped + d_clipped)))
            d_dual = tl.where(loss_ppo < loss_dual_bound, d_ppo,
                              tl.where(loss_ppo > loss_dual_bound, 0.0, 0.5 * d_ppo))
            grad = tl.where(negative, d_dual, d_ppo)
            grad = tl.where((log_ratio_raw >= -20.0) & (log_ratio_raw <= 20.0), grad, 0.0)
            if HAS_ISW:
                grad = grad * isw
            tl.store(grad_ptr + offs, tl.where(valid, grad * mask, 0.0), mask=ok)
    tl.store(stats_ptr + 0 * B + row, tl.sum(row_loss, axis=0))
    tl.store(stats_ptr + 1 * B + row, tl.sum(row_tokens, axis=0))
    tl.store(stats_ptr + 2 * B + row, tl.sum(row_clipped, axis=0))
    tl.store(stats_ptr + 3 * B + row, tl.sum(row_neg_kl, axis=0))
    tl.store(stats_ptr + 4 * B + row, tl.sum(row_clipped_lower, axis=0))


def row_pass(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
             response_mask: torch.Tensor, rollout_is_weights: Optional[torch.Tensor], clip_ratio_low: float,
             clip_ratio_high: float, clip_ratio_c: float, need_grad: bool, nan_safe_loss_sum: bool
             ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if log_prob.dtype == torch.float64:
        raise TypeError("the Triton PPO loss supports bf16/fp16/fp32 inputs, not fp64 (use backend='torch')")
    b, t = log_prob.shape
    mask = response_mask if response_mask.is_floating_point() else response_mask.to(torch.float32)
    stats = torch.empty(5, b, dtype=torch.float32, device=log_prob.device)
    grad = torch.empty(b, t, dtype=torch.float32, device=log_prob.device) if need_grad else stats
    isw = rollout_is_weights.contiguous() if rollout_is_weights is not None else log_prob
    if b > 0:
        _ppo_row_kernel[(b,)](old_log_prob.contiguous(), log_prob.contiguous(), advantages.contiguous(),
                              mask.contiguous(), isw, stats, grad, b, t,
                              float(clip_ratio_low), float(clip_ratio_high), float(clip_ratio_c),
                              HAS_ISW=rollout_is_weights is not None, NEED_GRAD=need_grad,
                              NAN_SAFE_LOSS_SUM=nan_safe_loss_sum, BLOCK_T=BLOCK_T)
    return stats, grad if need_grad else None
