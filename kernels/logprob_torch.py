"""Chunked torch backend of the fused kernels (CPU, and any device as a fallback the caller chooses).

Works on [rows × vocab-columns] chunks of logits (fused_logprob.plan_chunks) and updates in-place where it can,
so a chunk costs two buffers. The math is explained in row_stats (forward) and fused_logprob (backward).
`block_stats` / `block_grad` are the per-block row passes over logits that are already computed: the log-prob
op computes them per chunk here, the fused PPO loss (ppo_loss.py) with its own matmuls.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import row_stats
from .fused_logprob import accumulation_dtype, plan_chunks


def _chunk_logits(hidden_r: torch.Tensor, weight_c: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """z = (h·Wᵀ)/T for one chunk, in the accumulation dtype (a fresh buffer the caller may overwrite).

    16-bit inputs are upcast first: a 16-bit matmul would round every logit to 16 bits before the softmax."""
    acc = accumulation_dtype(hidden_r.dtype)
    z = hidden_r.to(acc) @ weight_c.to(acc).t()
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


def block_stats(z: torch.Tensor, labels_block: torch.Tensor, compute_entropy: bool = True, *,
                overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics (m, s, u, label logit) of one block of logits z [rows, cols]; `labels_block` is relative to
    the block's first column (outside [0, cols): the label is elsewhere, its logit counts 0 here).
    `overwrite=True` lets it shift z in place (saves a buffer when z is not needed afterwards)."""
    cols = z.shape[1]
    in_block = (labels_block >= 0) & (labels_block < cols)
    picked = z.gather(1, labels_block.clamp(0, cols - 1).unsqueeze(1)).squeeze(1)
    label_logit = torch.where(in_block, picked, torch.zeros_like(picked))
    m = z.amax(dim=1)
    shifted = z.sub_(m.unsqueeze(1)) if overwrite else z - m.unsqueeze(1)
    e = torch.exp(shifted)
    s = e.sum(dim=1)
    if compute_entropy:  # Σ e·(z−m) as a batched dot product: no third block-sized buffer
        u = torch.bmm(e.unsqueeze(1), shifted.unsqueeze(2)).view(-1)
    else:
        u = torch.zeros_like(s)
    return m, s, u, label_logit


def local_stats(hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor, inv_temp: float,
                compute_entropy: bool, chunk_size: Optional[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics (m, s, u, label logit) over all rows of `weight`; `labels_local` is -1 for foreign labels."""
    n, v = hidden.shape[0], weight.shape[0]
    acc = accumulation_dtype(hidden.dtype)
    m = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
    s = torch.zeros(n, dtype=acc, device=hidden.device)
    u = torch.zeros_like(s)
    label_logit = torch.zeros_like(s)
    rows, cols = plan_chunks(n, v, chunk_size)
    for c0 in range(0, v, cols):
        c1 = min(c0 + cols, v)
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            z = _chunk_logits(hidden[r0:r1], weight[c0:c1], inv_temp)
            m_c, s_c, u_c, ll_c = block_stats(z, labels_local[r0:r1] - c0, compute_entropy, overwrite=True)
            label_logit[r0:r1] += ll_c
            m[r0:r1], s[r0:r1], u[r0:r1] = row_stats.merge_stats(m[r0:r1], s[r0:r1], u[r0:r1], m_c, s_c, u_c)
    return m, s, u, label_logit


def block_grad(z: torch.Tensor, labels_block: torch.Tensor, lse_r: torch.Tensor, entropy_r: Optional[torch.Tensor],
               g_lp_r: Optional[torch.Tensor], g_ent_r: Optional[torch.Tensor], out_dtype: torch.dtype
               ) -> torch.Tensor:
    """dLoss/dz for one block of logits z [rows, cols] (OVERWRITTEN: z is dead after this), in `out_dtype`:
    −p·(g_lp + g_ent·(log p + H)) + g_lp·onehot(label), with `labels_block` relative to the block."""
    log_p = z.sub_(lse_r.unsqueeze(1))
    grad = torch.exp(log_p)  # p; becomes the gradient in place
    if g_ent_r is not None:
        coef = -g_ent_r * entropy_r if g_lp_r is None else -g_lp_r - g_ent_r * entropy_r
        # factor = coef − g_ent·log p, written over log_p in one pass
        factor = torch.addcmul(coef.unsqueeze(1), -g_ent_r.unsqueeze(1), log_p, out=log_p)
        grad.mul_(factor)
    elif g_lp_r is not None:
        grad.mul_(-g_lp_r.unsqueeze(1))
    else:
        grad.zero_()
    if g_lp_r is not None:
        cols = grad.shape[1]
        in_block = (labels_block >= 0) & (labels_block < cols)
        grad.scatter_add_(1, labels_block.clamp(0, cols - 1).unsqueeze(1),
                          torch.where(in_block, g_lp_r, torch.zeros_like(g_lp_r)).unsqueeze(1))
    return grad if grad.dtype == out_dtype else grad.to(out_dtype)


def grad_logits_chunk(hidden_r: torch.Tensor, weight_c: torch.Tensor, labels_c: torch.Tensor, lse_r: torch.Tensor,
                      entropy_r: Optional[torch.Tensor], g_lp_r: Optional[torch.Tensor],
                      g_ent_r: Optional[torch.Tensor], inv_temp: float) -> torch.Tensor:
    """dLoss/dz for one chunk, recomputing its logits (see block_grad). `labels_c` is chunk-relative."""
    z = _chunk_logits(hidden_r, weight_c, inv_temp)
    return block_grad(z, labels_c, lse_r, entropy_r, g_lp_r, g_ent_r, z.dtype)
