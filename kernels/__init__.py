"""Fused kernels (shipped as mppo.kernels): hidden states → log-prob + entropy without [tokens × vocab] logits, and
the clipped PPO loss in one pass. Each has a Triton implementation (CUDA; CPU under TRITON_INTERPRET=1), a chunked
torch implementation, and the naive reference; `backend` chooses (see backend.py). Triton is imported lazily.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import fused_logprob, ppo_loss, reference
from .backend import BACKENDS, logprob_backend, ppo_loss_backend, resolve_backend

__all__ = ["BACKENDS", "fused_linear_logprob_entropy", "fused_ppo_loss"]


def fused_linear_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                 temperature: float = 1.0, tp_group: Optional[dist.ProcessGroup] = None,
                                 chunk_size: Optional[int] = None, compute_entropy: bool = True,
                                 valid_vocab_size: Optional[int] = None, backend: str = "auto"
                                 ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log p(labels) and the softmax entropy of logits = hidden·weightᵀ / temperature, per token.

    hidden [N, H] and weight [V_local, H] share a dtype (bf16/fp16/fp32); labels [N] are GLOBAL token ids.
    Returns (log_probs [N], entropy [N] or None when compute_entropy=False), in fp32, differentiable w.r.t. hidden
    and weight. The logits are never materialised whole: they are processed in chunks of `chunk_size` vocab
    columns (default: ~4M logits per chunk) and recomputed in the backward from two saved numbers per token.
    Under torch.no_grad (old / reference log-probs) nothing is kept at all.

    Vocab parallel: with `tp_group`, `weight` is this rank's shard — global rows [rank·V_local, (rank+1)·V_local)
    as megatron's ColumnParallelLinear output layer holds them — and the result equals a full-vocab softmax on
    every rank. Pass hidden as replicated (NOT through copy_to_tensor_model_parallel_region, and gathered if
    sequence parallelism split it): the backward all-reduces grad_hidden over `tp_group` itself.
    `valid_vocab_size` (global) excludes the rows megatron pads the vocabulary with; set it to the HF config's
    vocab_size so the softmax runs over exactly the logits HF (and veRL) would compute.
    """
    name = resolve_backend(backend, hidden.device)
    if name == "naive":
        return reference.naive_linear_logprob_entropy(hidden, weight, labels, temperature=temperature,
                                                      tp_group=tp_group, valid_vocab_size=valid_vocab_size,
                                                      compute_entropy=compute_entropy)
    return fused_logprob.fused_logprob(logprob_backend(name, hidden.device), hidden, weight, labels,
                                       temperature=temperature, tp_group=tp_group, chunk_size=chunk_size,
                                       compute_entropy=compute_entropy, valid_vocab_size=valid_vocab_size)


def fused_ppo_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", *, clip_ratio_low: float = 0.2,
                   clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                   rollout_is_weights: Optional[torch.Tensor] = None, dp_size: int = 1,
                   batch_num_tokens: Optional[ppo_loss.Number] = None,
                   global_batch_size: Optional[ppo_loss.Number] = None,
                   loss_scale_factor: Optional[ppo_loss.Number] = None, backend: str = "auto"
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """veRL 0.9.1 "vanilla" PPO-clip policy loss in one pass over the tokens, with a precomputed backward.

    Same semantics as core_algos.compute_policy_loss(..., loss_mode="vanilla"): ratio = exp(clamp(Δlogp, ±20)),
    asymmetric clip [1 − clip_ratio_low, 1 + clip_ratio_high], dual clip at clip_ratio_c only where A < 0, the
    chosen aggregation with global batch info (dp_size, batch_num_tokens, global_batch_size, loss_scale_factor),
    and the metrics actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower as python floats.
    All inputs are [batch, response_len]; only log_prob is differentiated (the others are data).
    """
    name = resolve_backend(backend, log_prob.device)
    kwargs = dict(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                  rollout_is_weights=rollout_is_weights, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                  global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
    if name == "naive":
        return reference.naive_ppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, **kwargs)
    return ppo_loss.fused_ppo_loss(ppo_loss_backend(name, log_prob.device), old_log_prob, log_prob, advantages,
                                   response_mask, loss_agg_mode, **kwargs)
