"""Chunked torch backend of the fused log-prob/entropy op (CPU, and any device as a fallback the caller chooses).

Works on [rows × vocab-columns] chunks of logits (fused_logprob.plan_chunks) and updates in-place where it can,
so a chunk costs two buffers. The math is explained in row_stats (forward) and fused_logprob (backward).
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
            lab = labels_local[r0:r1] - c0
            in_chunk = (lab >= 0) & (lab < c1 - c0)
            picked = z.gather(1, lab.clamp(0, c1 - c0 - 1).unsqueeze(1)).squeeze(1)
            label_logit[r0:r1] = torch.where(in_chunk, picked, label_logit[r0:r1])
            m_c = z.amax(dim=1)
            z.sub_(m_c.unsqueeze(1))
            e = torch.exp(z)
            s_c = e.sum(dim=1)
            if compute_entropy:  # Σ e·(z−m) as a batched dot product: no third chunk-sized buffer
                u_c = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)
            else:
                u_c = torch.zeros_like(s_c)
            m[r0:r1], s[r0:r1], u[r0:r1] = row_stats.merge_stats(m[r0:r1], s[r0:r1], u[r0:r1], m_c, s_c, u_c)
    return m, s, u, label_logit


def grad_logits_chunk(hidden_r: torch.Tensor, weight_c: torch.Tensor, labels_c: torch.Tensor, lse_r: torch.Tensor,
                      entropy_r: Optional[torch.Tensor], g_lp_r: Optional[torch.Tensor],
                      g_ent_r: Optional[torch.Tensor], inv_temp: float) -> torch.Tensor:
    """dLoss/dz for one chunk: −p·(g_lp + g_ent·(log p + H)) + g_lp·onehot(label). `labels_c` is chunk-relative."""
    log_p = _chunk_logits(hidden_r, weight_c, inv_temp)
    log_p.sub_(lse_r.unsqueeze(1))
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
        in_chunk = (labels_c >= 0) & (labels_c < cols)
        grad.scatter_add_(1, labels_c.clamp(0, cols - 1).unsqueeze(1),
                          torch.where(in_chunk, g_lp_r, torch.zeros_like(g_lp_r)).unsqueeze(1))
    return grad
