"""The naive log-prob + entropy: the `backend="naive"` path, the tests' reference (run in float64), the benchmark
baseline. It materialises full [N × V] logits exactly as veRL's non-fused path does (log_softmax + gather for the
log-prob, logsumexp − Σ softmax·logits for the entropy), so it is both a readable specification and a fair
baseline. (The PPO loss's reference is core_algos.)
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
