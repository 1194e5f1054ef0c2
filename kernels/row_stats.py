"""Per-row softmax statistics that let a softmax be computed piece by piece (vocab chunks, Triton splits, TP ranks).

A piece of a row's logits z (one vocab chunk, or one TP rank's vocab shard) is summarised by three numbers:
    m = max_j z_j,   s = Σ_j exp(z_j - m),   u = Σ_j exp(z_j - m) · (z_j - m).
u is taken relative to the piece's own max so it stays small (no cancellation against a large m). Two pieces
merge exactly (`merge_stats`), and from the merged statistics of the whole row:
    lse = m + log s,   Σ_j p_j z_j = m + u / s,   entropy = lse - Σ p z = log s - u / s.
An empty piece is (m=-inf, s=0, u=0); every formula below guards it, because (-inf) · 0 is NaN.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _rescale(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, new_max: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, u) of a piece re-expressed relative to `new_max` (>= m); empty pieces (s == 0) stay (0, 0)."""
    nonempty = s > 0
    shift = torch.where(nonempty, m - new_max, torch.zeros_like(m))
    scale = torch.exp(shift)
    s_new = torch.where(nonempty, s * scale, torch.zeros_like(s))
    u_new = torch.where(nonempty, scale * (u + shift * s), torch.zeros_like(u))
    return s_new, u_new


def merge_stats(m1: torch.Tensor, s1: torch.Tensor, u1: torch.Tensor,
                m2: torch.Tensor, s2: torch.Tensor, u2: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Statistics of the union of two pieces of the same rows."""
    m = torch.maximum(m1, m2)
    s1, u1 = _rescale(m1, s1, u1, m)
    s2, u2 = _rescale(m2, s2, u2, m)
    return m, s1 + s2, u1 + u2


def merge_partials(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge [P, N] partial statistics (P pieces of N rows) into [N] statistics."""
    m_all = m.amax(dim=0)
    s_r, u_r = _rescale(m, s, u, m_all.unsqueeze(0))
    return m_all, s_r.sum(dim=0), u_r.sum(dim=0)


def all_reduce_stats(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, label_logit: torch.Tensor,
                     tp_group: dist.ProcessGroup | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine per-rank statistics of vocab shards into full-vocab statistics (identity without a group).

    `label_logit` is the label's logit on the rank that owns the label and 0 elsewhere, so a sum recovers it.
    Two collectives: a MAX of m, then one SUM of the stacked (s, u, label_logit) rescaled to that max.
    """
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return m, s, u, label_logit
    m_global = m.clone()
    dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=tp_group)
    s, u = _rescale(m, s, u, m_global)
    packed = torch.stack([s, u, label_logit])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    return m_global, packed[0], packed[1], packed[2]


def finalize(m: torch.Tensor, s: torch.Tensor, u: torch.Tensor, label_logit: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob of the label, entropy, lse) per row from full-row statistics."""
    log_s = torch.log(s)
    lse = m + log_s
    entropy = log_s - u / s
    return label_logit - lse, entropy, lse
