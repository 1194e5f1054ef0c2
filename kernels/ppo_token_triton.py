"""Triton token step of the fused PPO loss (CUDA; CPU under TRITON_INTERPRET=1): for one row chunk, from the
full-row statistics to the log-probs, entropies, loss terms and gradient coefficients, in ONE launch — the same
math as ppo_token_loss.token_step (finalize + token_terms), which in torch is ~50 tiny kernels per chunk and on a
GPU would cost about as much launch time as the chunk's matmuls. Tie rules are torch autograd's, as there.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .ppo_token_loss import (K3_LOG_RATIO_CLAMP, K3_VALUE_CLAMP, LOG_RATIO_CLAMP, PPOTokenLoss,
                             TokenResults)

BLOCK = 1024
# kl_loss_type base name -> the kernel's KL_KIND
KL_KINDS = {"kl": 0, "k1": 0, "abs": 1, "mse": 2, "k2": 2, "low_var_kl": 3, "k3": 3}
# jit functions read module globals only as constexpr
_LR_CLAMP = tl.constexpr(LOG_RATIO_CLAMP)
_K3_LR_CLAMP = tl.constexpr(K3_LOG_RATIO_CLAMP)
_K3_VALUE_CLAMP = tl.constexpr(K3_VALUE_CLAMP)


@triton.jit
def _token_kernel(m_ptr, s_ptr, u_ptr, ll_ptr, adv_ptr, w_ptr, old_ptr, isw_ptr, ref_ptr,
                  lp_out, ent_out, pg_out, kl_out, clip_out, clip_lower_out, neg_kl_out, lse_out, g_lp_out,
                  g_ent_out, R, r0, clip_low, clip_high, clip_c, entropy_coeff, kl_coef, inv_temp,
                  HAS_OLD: tl.constexpr, HAS_ISW: tl.constexpr, HAS_KL: tl.constexpr, KL_KIND: tl.constexpr,
                  KL_STRAIGHT_THROUGH: tl.constexpr, HAS_ENT_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < R
    t = r0 + i  # index into the whole input's per-token arrays
    m = tl.load(m_ptr + i, mask=ok, other=0.0)
    s = tl.load(s_ptr + i, mask=ok, other=1.0)
    u = tl.load(u_ptr + i, mask=ok, other=0.0)
    label_logit = tl.load(ll_ptr + i, mask=ok, other=0.0)
    log_s = tl.log(s)
    lse = m + log_s
    entropy = log_s - u / s
    lp = label_logit - lse
    adv = tl.load(adv_ptr + t, mask=ok, other=0.0)
    w = tl.load(w_ptr + t, mask=ok, other=0.0)
    if HAS_OLD:
        old = tl.load(old_ptr + t, mask=ok, other=0.0)
    else:
        old = lp  # on-policy: ratio exactly 1

    # vanilla PPO clip with dual clip (ppo_token_loss._vanilla)
    log_ratio_raw = lp - old
    log_ratio = tl.minimum(tl.maximum(log_ratio_raw, -_LR_CLAMP), _LR_CLAMP)
    ratio = tl.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * tl.minimum(tl.maximum(ratio, 1.0 - clip_low), 1.0 + clip_high)
    loss_ppo = tl.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -adv * clip_c
    negative = adv < 0.0
    pg = tl.where(negative, tl.minimum(loss_dual_bound, loss_ppo), loss_ppo)
    d_unclipped = -adv * ratio
    in_clip = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
    d_clipped = tl.where(in_clip, d_unclipped, 0.0)
    d_ppo = tl.where(loss_unclipped > loss_clipped, d_unclipped,
                     tl.where(loss_unclipped < loss_clipped, d_clipped, 0.5 * (d_unclipped + d_clipped)))
    d_dual = tl.where(loss_ppo < loss_dual_bound, d_ppo, tl.where(loss_ppo > loss_dual_bound, 0.0, 0.5 * d_ppo))
    d_pg = tl.where(negative, d_dual, d_ppo)
    d_pg = tl.where((log_ratio_raw >= -_LR_CLAMP) & (log_ratio_raw <= _LR_CLAMP), d_pg, 0.0)
    if HAS_ISW:
        isw = tl.load(isw_ptr + t, mask=ok, other=0.0)
        pg = pg * isw
        d_pg = d_pg * isw
    g_lp = d_pg

    if HAS_KL:  # core_algos.kl_penalty (ppo_token_loss._kl)
        ref = tl.load(ref_ptr + t, mask=ok, other=0.0)
        diff = lp - ref
        if KL_KIND == 0:
            kl = diff
            d_kl = tl.full(diff.shape, 1.0, tl.float32)
        elif KL_KIND == 1:
            kl = tl.abs(diff)
            d_kl = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        elif KL_KIND == 2:
            kl = 0.5 * diff * diff
            d_kl = diff
        else:
            x = ref - lp
            k = tl.minimum(tl.maximum(x, -_K3_LR_CLAMP), _K3_LR_CLAMP)
            estimate = tl.exp(k) - k - 1.0
            kl = tl.minimum(tl.maximum(estimate, -_K3_VALUE_CLAMP), _K3_VALUE_CLAMP)
            passes = ((x >= -_K3_LR_CLAMP) & (x <= _K3_LR_CLAMP)
                      & (estimate >= -_K3_VALUE_CLAMP) & (estimate <= _K3_VALUE_CLAMP))
            d_kl = tl.where(passes, 1.0 - tl.exp(k), 0.0)
        if KL_STRAIGHT_THROUGH:
            d_kl = diff
        g_lp = g_lp + kl_coef * d_kl
        tl.store(kl_out + t, kl, mask=ok)

    tl.store(lp_out + t, lp, mask=ok)
    tl.store(ent_out + t, entropy, mask=ok)
    tl.store(pg_out + t, pg, mask=ok)
    tl.store(clip_out + t, tl.where(loss_clipped > loss_unclipped, 1.0, 0.0), mask=ok)
    tl.store(clip_lower_out + t, tl.where((loss_ppo > loss_dual_bound) & negative, 1.0, 0.0), mask=ok)
    tl.store(neg_kl_out + t, -log_ratio, mask=ok)
    tl.store(lse_out + i, lse, mask=ok)
    tl.store(g_lp_out + i, g_lp * w * inv_temp, mask=ok)
    if HAS_ENT_GRAD:
        tl.store(g_ent_out + i, -entropy_coeff * w * inv_temp, mask=ok)


def token_step(spec: PPOTokenLoss, results: TokenResults, r0: int, r1: int, m: torch.Tensor, s: torch.Tensor,
               u: torch.Tensor, label_logit: torch.Tensor, inv_temp: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """ppo_token_loss.token_step in one launch; `spec` is already in fp32 (PPOTokenLoss.to)."""
    if m.dtype != torch.float32:
        raise TypeError(f"the Triton token step runs in fp32, got {m.dtype} (use backend='torch' for fp64)")
    count = r1 - r0
    lse = torch.empty(count, dtype=torch.float32, device=m.device)
    g_lp = torch.empty_like(lse)
    has_ent_grad = spec.entropy_coeff != 0
    g_ent = torch.empty_like(lse) if has_ent_grad else None
    has_kl = results.kl is not None
    kl_base = spec.kl_loss_type[:-1] if spec.kl_loss_type.endswith("+") else spec.kl_loss_type
    dummy = spec.advantages  # never read when the matching HAS_* flag is off
    _token_kernel[(triton.cdiv(count, BLOCK),)](
        m.contiguous(), s.contiguous(), u.contiguous(), label_logit.contiguous(), spec.advantages, spec.weights,
        spec.old_log_prob if spec.old_log_prob is not None else dummy,
        spec.rollout_is_weights if spec.rollout_is_weights is not None else dummy,
        spec.ref_log_prob if has_kl else dummy,
        results.log_probs, results.entropy, results.pg, results.kl if has_kl else results.pg, results.clipped,
        results.clipped_lower, results.neg_log_ratio, lse, g_lp, g_ent if has_ent_grad else g_lp,
        count, r0, float(spec.clip_ratio_low), float(spec.clip_ratio_high), float(spec.clip_ratio_c),
        float(spec.entropy_coeff), float(spec.kl_loss_coef), float(inv_temp),
        HAS_OLD=spec.old_log_prob is not None, HAS_ISW=spec.rollout_is_weights is not None, HAS_KL=has_kl,
        KL_KIND=KL_KINDS.get(kl_base, 0) if has_kl else 0,
        KL_STRAIGHT_THROUGH=has_kl and spec.kl_loss_type.endswith("+"), HAS_ENT_GRAD=has_ent_grad, BLOCK=BLOCK)
    return lse, results.entropy[r0:r1], g_lp, g_ent
