"""Naive implementations: the `backend="naive"` path, the tests' reference (run in float64), the benchmark baseline.

They materialise full [N × V] logits exactly as veRL's non-fused path does (log_softmax + gather for the log-prob,
logsumexp − Σ softmax·logits for the entropy), so they are both a readable specification and a fair baseline.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def naive_linear_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                 temperature: float = 1.0, tp_group: Optional[dist.ProcessGroup] = None,
                                 valid_vocab_size: Optional[int] = None, compute_entropy: bool = True
                                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(label) and entropy per row from full logits; vocab-parallel via megatron-core's TP mappings
    (which allocate on CUDA: on CPU they need mppo.parallel's compat layer, installed by init_distributed)."""
    tp = tp_group is not None and dist.get_world_size(tp_group) > 1
    if tp:  # lazy: megatron-core costs seconds to import and only this path needs it
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_tensor_model_parallel_region)
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    logits = hidden @ weight.t()
    if tp:
        logits = gather_from_tensor_model_parallel_region(logits, group=tp_group)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if valid_vocab_size is not None:
        logits = logits[:, :valid_vocab_size]  # padded vocab rows are not tokens
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if not compute_entropy:
        return log_probs, None
    entropy = torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return log_probs, entropy


def _masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    masked = torch.where(mask != 0, values, torch.zeros_like(values)) * mask
    return masked.sum() if dim is None else masked.sum(dim)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    return _masked_sum(values, mask, dim) / ((mask.sum() if dim is None else mask.sum(dim)) + 1e-8)


def naive_agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
                   batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None) -> torch.Tensor:
    """veRL 0.9.1 agg_loss (ppo_math.md §4), written out token by token."""
    if loss_agg_mode == "token-mean":
        if dp_size > 1 and batch_num_tokens is None:
            raise ValueError("token-mean with dp_size > 1 needs batch_num_tokens")
        return _masked_sum(loss_mat, loss_mask) / (batch_num_tokens or loss_mask.sum()) * dp_size
    if loss_agg_mode == "token-sum":
        return _masked_sum(loss_mat, loss_mask) * dp_size
    if dp_size > 1 and global_batch_size is None:
        raise ValueError(f"{loss_agg_mode} with dp_size > 1 needs global_batch_size")
    seq_has_tokens = (loss_mask.sum(-1) > 0).to(loss_mat.dtype)
    n_seq = global_batch_size or seq_has_tokens.sum()
    seq_losses = (loss_mat * loss_mask).sum(-1)  # plain sum, not masked_sum: NaN under the mask propagates
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / (loss_mask.sum(-1) + 1e-8)
    elif loss_agg_mode not in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")
    loss = _masked_sum(seq_losses, seq_has_tokens) / n_seq * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_scale_factor or loss_mask.shape[-1])
    return loss


def naive_ppo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *, clip_ratio_low: float = 0.2,
                   clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                   rollout_is_weights: Optional[torch.Tensor] = None, dp_size: int = 1, batch_num_tokens=None,
                   global_batch_size=None, loss_scale_factor=None) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL 0.9.1 compute_policy_loss_vanilla (ppo_math.md §5) with plain autograd."""
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    ppo_kl = _masked_mean(-log_ratio, mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _masked_mean(torch.gt(pg_losses2, pg_losses1).to(mask.dtype), mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = _masked_mean((torch.gt(clip_pg_losses1, pg_losses3) & (advantages < 0)).to(mask.dtype), mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    pg_loss = naive_agg_loss(pg_losses, mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size,
                             loss_scale_factor)
    metrics = {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
               "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}
    return pg_loss, metrics
