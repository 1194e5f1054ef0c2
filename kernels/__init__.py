"""Fused kernels (shipped as mppo.kernels), both without [tokens × vocab] logits:
  * fused_linear_logprob_entropy: hidden states → log-prob + entropy (the no-grad passes, and training with loss
    modes the fused loss does not cover: it recomputes the logits in its backward);
  * fused_linear_ppo_loss: hidden states → log-prob + entropy → clipped PPO loss (+ entropy bonus, KL loss), with
    the gradients computed during the forward.
Each has a Triton backend (CUDA; CPU under TRITON_INTERPRET=1) and a chunked torch backend; `backend` chooses (see
backend.py). Triton is imported lazily.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import fused_logprob, ppo_loss, reference
from .backend import BACKENDS, logprob_backend, resolve_backend, token_step_for
from .ppo_loss import STAT_NAMES, FusedPPOLossOutput
from .ppo_token_loss import PPOTokenLoss

__all__ = ["BACKENDS", "STAT_NAMES", "FusedPPOLossOutput", "PPOTokenLoss", "fused_linear_logprob_entropy",
           "fused_linear_ppo_loss"]


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


def fused_linear_ppo_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, spec: PPOTokenLoss, *,
                          temperature: float = 1.0, tp_group: Optional[dist.ProcessGroup] = None,
                          valid_vocab_size: Optional[int] = None, chunk_rows: Optional[int] = None,
                          block_cols: Optional[int] = None, backend: str = "auto") -> FusedPPOLossOutput:
    """veRL's vanilla PPO loss (+ entropy bonus, + KL-to-reference loss) of the tokens whose final hidden states
    are `hidden`, straight from hidden·weightᵀ/temperature, with d(hidden) and d(weight) computed in the same
    pass (6·N·V·H FLOPs; the log-prob op + autograd costs 8). `spec` (ppo_token_loss.PPOTokenLoss) gives each
    token's advantage, aggregation weight (core_algos.agg_token_weights), mask, old / reference log-prob and
    rollout IS weight, and the loss knobs.

    hidden [N, H], weight [V_local, H] (one dtype), labels [N] global token ids: as fused_linear_logprob_entropy,
    including `tp_group` (weight is this rank's vocab shard, hidden replicated; d(hidden) is all-reduced here)
    and `valid_vocab_size`. The returned `loss` backpropagates the stored gradients scaled by grad_output; its
    `log_probs`, `entropy` and `stats` are detached. Logits live one row chunk at a time (`chunk_rows` rows,
    default ~128 MiB of fp32 logits; `block_cols` vocab columns per block). The naive backend is not offered:
    core_algos on fused_linear_logprob_entropy's outputs is the reference path.
    """
    name = resolve_backend(backend, hidden.device)
    if name == "naive":
        raise ValueError("fused_linear_ppo_loss has no naive backend: compute log-probs with "
                         "fused_linear_logprob_entropy(backend='naive') and the loss with core_algos")
    return ppo_loss.fused_ppo_loss(logprob_backend(name, hidden.device), token_step_for(name, hidden.device),
                                   hidden, weight, labels, spec,
                                   temperature=temperature, tp_group=tp_group, valid_vocab_size=valid_vocab_size,
                                   chunk_rows=chunk_rows, block_cols=block_cols)
