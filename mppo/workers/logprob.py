"""Per-token log-probs (and entropy) of the response tokens, for the actor and the reference policy.

Two implementations of hidden states -> log p(token), selected by `actor.logprob_impl`:
- "fused": `mppo.kernels.fused_linear_logprob_entropy`, which never holds the [tokens x vocab] logits
  (backend from `actor.kernel_backend`);
- "naive": megatron's vocab-parallel cross entropy on full fp32 logits
  (`vocab_parallel_logprob_entropy`).
Both run only on the valid response positions, with logits divided by the temperature (as the rollout does).

The optimal-token-baseline estimators also need `sum_pi_squared` = sum over the vocabulary of p^2 per token
(`actor.calculate_sum_pi_squared`). Neither kernel returns it, so `vocab_parallel_sum_pi_squared` computes it in
torch from the same hidden states, in row chunks (no [tokens x vocab] tensor of the whole batch), forward only.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.vocab import mask_padded_logits, valid_vocab_size_per_rank
from mppo.parallel.context_parallel import sum_over_cp
from mppo.workers.base import output_weight, response_rows
from mppo.workers.batching import Batch
from mppo.workers.pipeline import micro_batches_for, response_forward_step, run_forward_only

# (hidden [N, h], weight shard [V_local, h], labels [N], temperature, valid vocab, compute_entropy)
#   -> (log_probs [N] fp32, entropy [N] fp32 or None)
TokenLogProbFn = Callable[..., tuple[torch.Tensor, "torch.Tensor | None"]]
LOGPROB_IMPLS = ("fused", "naive")


def make_logprob_fn(impl: str, kernel_backend: str = "auto") -> TokenLogProbFn:
    """The hidden -> (log-prob, entropy) function for `actor.logprob_impl`."""
    from megatron.core import parallel_state as ps

    if impl == "naive":
        def naive(hidden, weight, labels, *, temperature, valid_vocab_size, compute_entropy):
            log_probs, entropy = vocab_parallel_logprob_entropy(
                hidden, weight, labels, temperature=temperature, valid_vocab_size=valid_vocab_size)
            return log_probs, (entropy if compute_entropy else None)
        return naive
    if impl == "fused":
        try:
            from mppo.kernels import fused_linear_logprob_entropy
        except ImportError as err:
            raise ImportError(f"actor.logprob_impl='fused' needs mppo.kernels, which does not import ({err}); "
                              "reinstall mppo (pip install -e .) or set actor.logprob_impl=naive") from err

        def fused(hidden, weight, labels, *, temperature, valid_vocab_size, compute_entropy):
            return fused_linear_logprob_entropy(
                hidden, weight, labels, temperature=temperature, tp_group=ps.get_tensor_model_parallel_group(),
                valid_vocab_size=valid_vocab_size, compute_entropy=compute_entropy, backend=kernel_backend)
        return fused
    raise ValueError(f"actor.logprob_impl must be one of {LOGPROB_IMPLS}, got {impl!r}")


def vocab_parallel_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   temperature: float, tp_group: Any = None,
                                   valid_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy of softmax(hidden @ weight.T / temperature) over the TP-split vocabulary.

    Differentiable. Uses megatron's `vocab_parallel_cross_entropy` (which works on megatron's TP group) and
    its autograd-aware TP collectives, and materialises this rank's [N, V_local] logits in fp32. With bf16
    weights the product is taken in fp32 too (as the fused kernel does): a bf16 matmul would round every logit to
    8 significant bits before the softmax.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    group = ps.get_tensor_model_parallel_group()
    if tp_group is not None and tp_group is not group:
        raise ValueError("vocab_parallel_logprob_entropy runs on megatron's tensor-parallel group only")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    local_valid = valid_vocab_size_per_rank(valid_vocab_size, weight.shape[0] * tp, tp_rank, tp)
    # Each rank sees only its vocab slice: the gradient w.r.t. the replicated hidden states is a sum over ranks.
    hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    logits = torch.matmul(hidden.float(), weight.float().t()) / temperature
    logits = mask_padded_logits(logits, local_valid)
    # vocab_parallel_cross_entropy overwrites fp32 logits in place: give it its own copy.
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)

    local_max = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max
    exp = shifted.exp()
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    sum_exp_z = tensor_parallel.reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    entropy = sum_exp.log() - sum_exp_z / sum_exp
    return log_probs, entropy


def response_logprobs(model: nn.Module, hidden: torch.Tensor, data: Batch, logprob_fn: TokenLogProbFn, *,
                      temperature: float, vocab_size: int,
                      compute_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) [b, T] fp32 (and entropy [b, T]) from a last stage's hidden states [s, b, h];
    0 at response positions that are not attended (padding). Under context parallelism `hidden` holds this CP
    rank's positions and `data` is the CP-local view: each rank computes its own tokens and the grids are summed
    over CP, so every CP rank returns the whole sequence's."""
    valid = data["response_valid"]
    if not bool(valid.any()):
        # no response token here (e.g. one row with an empty response): zeros, still attached to the hidden
        # states so that the pipeline's backward has a gradient to pass on
        # (under CP other ranks may hold tokens of these rows: each grid is still summed with theirs)
        def zeros() -> torch.Tensor:
            return sum_over_cp(torch.zeros(valid.shape, dtype=torch.float32, device=hidden.device) + hidden.sum() * 0.0)
        return zeros(), (zeros() if compute_entropy else None)
    selected = response_rows(hidden, data, valid_only=True)  # [N, h], N = valid response tokens
    labels = data["responses"][valid]
    log_probs, entropy = logprob_fn(selected, output_weight(model), labels, temperature=temperature,
                                    valid_vocab_size=vocab_size, compute_entropy=compute_entropy)

    def to_grid(values: torch.Tensor) -> torch.Tensor:
        # masked_scatter keeps autograd through `values`; positions outside `valid` stay 0
        return torch.zeros(valid.shape, dtype=torch.float32, device=values.device).masked_scatter(
            valid, values.float())

    return sum_over_cp(to_grid(log_probs)), (sum_over_cp(to_grid(entropy)) if entropy is not None else None)


def vocab_parallel_sum_pi_squared(hidden: torch.Tensor, weight: torch.Tensor, *, temperature: float,
                                  valid_vocab_size: int, chunk_rows: int = 1024) -> torch.Tensor:
    """sum_v softmax(hidden @ weight.T / temperature)_v^2 per row [N] fp32 over the TP-split vocabulary (no grad).

    With m = the row max and S_k = sum_v exp(k (z_v - m)): sum p^2 = S_2 / S_1^2; the max and both sums are
    reduced over the tensor-parallel group."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    local_valid = valid_vocab_size_per_rank(valid_vocab_size, weight.shape[0] * tp, tp_rank, tp)
    out = []
    with torch.no_grad():
        w = weight.detach().float()
        for start in range(0, hidden.shape[0], chunk_rows):
            z = mask_padded_logits(hidden[start:start + chunk_rows].detach().float() @ w.t() / temperature,
                                   local_valid)
            row_max = z.max(dim=-1).values
            if tp > 1:
                torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=group)
            shifted = (z - row_max[:, None]).exp()
            sums = torch.stack([shifted.sum(dim=-1), (shifted * shifted).sum(dim=-1)])
            if tp > 1:
                torch.distributed.all_reduce(sums, group=group)
            out.append(sums[1] / (sums[0] * sums[0]))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)


def compute_response_outputs(model_chunks: Sequence[nn.Module], batch: Batch, logprob_fn: TokenLogProbFn, *,
                             vocab_size: int, temperature: float, micro_batch_size: int | None,
                             max_token_len: int | None, calculate_entropy: bool = False,
                             calculate_sum_pi_squared: bool = False,
                             phase: str = "log_prob") -> dict[str, torch.Tensor]:
    """Forward-only {"log_probs"[, "entropy"][, "sum_pi_squared"]}, each [B, T] fp32 and 0 off the response, of a
    validated batch, on every rank (`phase`: its name in TOKEN_COUNTER)."""
    rows = torch.arange(batch["input_ids"].shape[0])
    micro_batches = micro_batches_for(batch, rows, model_chunks, micro_batch_size=micro_batch_size,
                                      max_token_len=max_token_len)

    def make_loss_fn(model, data):
        def loss_fn(hidden):
            log_probs, entropy = response_logprobs(model, hidden, data, logprob_fn, temperature=temperature,
                                                   vocab_size=vocab_size, compute_entropy=calculate_entropy)
            outputs = {"log_probs": log_probs}
            if entropy is not None:
                outputs["entropy"] = entropy
            if calculate_sum_pi_squared:
                valid = data["response_valid"]
                grid = torch.zeros(valid.shape, dtype=torch.float32, device=hidden.device)
                if bool(valid.any()):
                    grid[valid] = vocab_parallel_sum_pi_squared(response_rows(hidden, data, valid_only=True),
                                                                output_weight(model), temperature=temperature,
                                                                valid_vocab_size=vocab_size)
                outputs["sum_pi_squared"] = sum_over_cp(grid)
            return log_probs.sum(), outputs
        return loss_fn

    step = response_forward_step(make_loss_fn, hidden_only=True)
    return run_forward_only(model_chunks, micro_batches, step, len(rows), phase=phase)
