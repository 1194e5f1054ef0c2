"""Context parallelism's load-balanced sequence split and the collectives that undo it.

A sequence of s positions is cut into 2·CP chunks of s / (2·CP); CP rank r holds chunks r and 2·CP-1-r, in that
order (megatron's `get_batch_on_this_cp_rank`, and the split its RotaryEmbedding applies to the rotary angles).
Under causal attention chunk j costs work ∝ j + 1, so pairing an early chunk with a late one gives every rank the
same work and memory.

- `cp_positions` / `split_for_cp`: which natural positions a rank holds; the rank's slice of a tensor.
- `natural_order`: the index that puts the ranks' slices, concatenated in rank order, back in natural order.
- `gather_for_cp`: all-gather over CP (first dimension) into natural order; its backward reduce-scatters (each
  rank gets the sum over ranks of the gradient at its own positions). For attention's K/V: every rank's queries
  read every rank's keys.
- `sum_over_cp`: all-reduce (sum) with an identity backward, for per-token outputs that each rank fills at its own
  tokens and leaves 0 elsewhere (a gather by sum: x + 0 is exact). Everything after it is computed identically on
  every CP rank, so each rank's gradient there is already the whole gradient; the rank's own entries (the only ones
  with a path back to its activations) take theirs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def cp_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The natural positions [seq_len / cp] CP rank `cp_rank` holds: chunk cp_rank, then chunk 2·cp-1-cp_rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism needs a sequence length divisible by 2*cp = {2 * cp}, got {seq_len}; "
                         "pad the micro-batch (mppo.workers.pipeline.sequence_multiple)")
    chunk = seq_len // (2 * cp)
    starts = (cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk, device=device) for start in starts])


def split_for_cp(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's positions of `x` along `dim` (a copy)."""
    return x.index_select(dim, cp_positions(x.shape[dim], cp, cp_rank, device=x.device))


def natural_order(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Index into the rank-ordered concatenation of every rank's slice that gives natural order."""
    held = torch.cat([cp_positions(seq_len, cp, r, device=device) for r in range(cp)])
    return torch.argsort(held)


def cp_group():
    """megatron's context-parallel group."""
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def cp_world_size() -> int:
    """The context-parallel size (1 before megatron's groups exist)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1
    return parallel_state.get_context_parallel_world_size()


class _GatherForCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        cp = dist.get_world_size(group)
        ctx.group, ctx.cp = group, cp
        gathered = x.new_empty((cp * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x.contiguous(), group=group)
        return gathered.index_select(0, natural_order(gathered.shape[0], cp, device=x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cp = ctx.cp
        held = torch.cat([cp_positions(grad.shape[0], cp, r, device=grad.device) for r in range(cp)])
        rank_ordered = grad.index_select(0, held).contiguous()
        out = grad.new_empty((grad.shape[0] // cp, *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, rank_ordered, group=ctx.group)
        return out, None


def gather_for_cp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Every CP rank's slice of a sequence along the first dimension (this rank's is `x`) in natural order; the
    backward reduce-scatters the gradient (sum over ranks, this rank's positions)."""
    return _GatherForCP.apply(x, group if group is not None else cp_group())


class _SumOverCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_cp(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the CP ranks (identity backward; see the module docstring); `x` itself without CP."""
    if cp_world_size() == 1:
        return x
    return _SumOverCP.apply(x, cp_group())
