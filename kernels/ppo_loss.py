"""Fused hidden → logits → log-prob + entropy → PPO loss with the gradient computed during the forward (Liger's
scheme): the backend-independent half — chunk plan, matmuls, TP combine, autograd.

Why in the forward: the log-prob op (fused_logprob) keeps two numbers per token and recomputes each chunk of
logits in its backward, 8·N·V·H FLOPs in all. Here every row chunk's logits [rows × V_local] are computed once,
their row statistics give the tokens' log-probs and entropies, the PPO loss turns those into ∂L/∂logp and ∂L/∂H
at once (ppo_token_loss: for the loss modes whose token gradients are known without the other tokens), and the
chunk's d(logits) goes straight into d(hidden) and d(weight): 6·N·V·H FLOPs, one pass. The autograd backward only
scales the stored gradients by grad_output, so megatron's pipeline schedules call it like any loss.

A backend (logprob_torch, logprob_triton) supplies the two row passes over a block of computed logits:
  * `block_stats(z, labels_block)` → (m, s, u, label_logit) per row (row_stats);
  * `block_grad(z, labels_block, lse, entropy, g_lp, g_ent, out_dtype)` → dL/dz, may overwrite z;
and a `token_step` turns a chunk's full-row statistics into its token results and gradient coefficients
(ppo_token_loss.token_step in torch; ppo_token_triton.token_step, one launch per chunk on the GPU).
Matmuls run in torch (cuBLAS on GPU) with fp32 logits whatever the input dtype (the log-probs feed an
importance ratio); d(logits) is cast to the input dtype for the two gradient matmuls, as the log-prob op does.

Vocab parallel: `weight` is this rank's shard; the row statistics of each chunk are all-reduced over the TP group
inside the chunk loop (two small collectives), so every TP rank computes the same token losses; d(hidden) is the
sum of the shards' contributions, all-reduced once at the end (hidden is replicated across TP, as in
fused_logprob); d(weight) stays local.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import row_stats
from .fused_logprob import _Shard, accumulation_dtype, prepare_inputs
from .ppo_token_loss import PPOTokenLoss, TokenResults

# Logits kept per row chunk (fp32 elements); rows per chunk = this / local vocab, balanced over the chunks. Every
# chunk's d(weight) matmul reads and writes the whole [V, H] gradient once and has only the chunk's rows as its
# inner dimension, so more rows per chunk is faster and fewer rows is less memory. CPU: 2^27 (512 MiB, ~880 rows of
# a 151,936 vocabulary; measured with mppo bench kernels, bench/RESULTS.md); CUDA: 2^25 (128 MiB, ~220 rows).
CHUNK_LOGITS = {"cpu": 1 << 27, "cuda": 1 << 25}
# Columns per block inside a chunk on CPU: a block's temporaries stay cache-sized (the log-prob op's 16 MiB).
# On CUDA one block spans the vocabulary (one matmul each; fewer launches).
CPU_BLOCK_ELEMENTS = 1 << 22
MIN_BLOCK_COLS = 256
STAT_NAMES = ("pg_loss", "entropy_loss", "kl_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower")


def plan_loss_chunks(n_rows: int, n_cols: int, device: torch.device, chunk_rows: Optional[int],
                     block_cols: Optional[int]) -> tuple[int, int]:
    """(rows per chunk, vocab columns per block)."""
    budget = CHUNK_LOGITS.get(device.type, CHUNK_LOGITS["cuda"])
    rows = chunk_rows if chunk_rows is not None else budget // max(n_cols, 1)
    rows = max(1, min(rows, max(n_rows, 1)))
    chunks = -(-max(n_rows, 1) // rows)
    rows = -(-max(n_rows, 1) // chunks)  # the same number of rows in every chunk (no small last one)
    if block_cols is None:  # CPU: a multiple of 256 (an odd width such as 5115 ran its matmul at 0.6x the speed)
        block_cols = n_cols if device.type == "cuda" else max(MIN_BLOCK_COLS, CPU_BLOCK_ELEMENTS // rows // 256 * 256)
    return rows, max(1, min(block_cols, max(n_cols, 1)))


@dataclass
class FusedPPOLossOutput:
    """`loss` carries the gradient (w.r.t. hidden and weight); everything else is detached.

    loss = pg_loss − entropy_coeff·entropy_loss + kl_loss_coef·kl_loss over the tokens given, each term
    aggregated with the token weights. `stats` [6] holds STAT_NAMES in order (pg_loss, entropy_loss, kl_loss — 0
    without a KL term — and the masked means pg_clipfrac, ppo_kl, pg_clipfrac_lower of veRL's vanilla loss), so
    a caller reads them with one device sync.
    """

    loss: torch.Tensor
    stats: torch.Tensor
    log_probs: torch.Tensor  # [N] fp32 (fp64 for fp64 inputs)
    entropy: torch.Tensor  # [N]

    def stat(self, name: str) -> torch.Tensor:
        return self.stats[STAT_NAMES.index(name)]


_MM_OUT_DTYPE = [True]  # flips to False the first time torch.mm(out_dtype=) is missing


def _logits_into(z: torch.Tensor, hidden_r: torch.Tensor, weight_c: torch.Tensor, inv_temp: float) -> None:
    """z = (h·Wᵀ)/T in z's (accumulation) dtype without rounding the logits to a 16-bit input dtype."""
    if hidden_r.dtype == z.dtype:
        torch.mm(hidden_r, weight_c.t(), out=z)
    elif hidden_r.is_cuda and _MM_OUT_DTYPE[0]:  # 16-bit on tensor cores, fp32 accumulate and output
        try:
            torch.mm(hidden_r, weight_c.t(), out_dtype=z.dtype, out=z)
        except (TypeError, RuntimeError):  # torch < 2.8 has no mm(out_dtype=)
            _MM_OUT_DTYPE[0] = False
            _logits_into(z, hidden_r, weight_c, 1.0)
    else:  # no 16-bit → fp32 matmul here (CPU, old torch): upcast the operands
        torch.mm(hidden_r.to(z.dtype), weight_c.to(z.dtype).t(), out=z)
    if inv_temp != 1.0:
        z.mul_(inv_temp)


def _run(backend: ModuleType, token_step: Callable, hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor,
         shard: _Shard, inv_temp: float, spec: PPOTokenLoss, chunk_rows: Optional[int], block_cols: Optional[int],
         need_hidden: bool, need_weight: bool):
    """(loss, stats, log_probs, entropy, grad_hidden or None, grad_weight or None)."""
    n, h = hidden.shape
    dtype, acc, device = hidden.dtype, accumulation_dtype(hidden.dtype), hidden.device
    valid = shard.local_valid if n > 0 else 0
    rows, cols = plan_loss_chunks(n, valid, device, chunk_rows, block_cols)
    results = TokenResults(n, acc, device, with_kl=spec.kl_loss_coef != 0)
    spec = spec.to(acc)
    grad_h = torch.empty(n, h, dtype=dtype, device=device) if need_hidden else None
    grad_w = None
    if need_weight:  # the first chunk writes the valid rows; vocab padding rows stay 0
        grad_w = torch.empty_like(weight)
        grad_w[valid:].zero_()
    logits = torch.empty(rows * valid, dtype=acc, device=device)  # one chunk's logits, block after block
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        count, hidden_r, labels_r = r1 - r0, hidden[r0:r1], labels_local[r0:r1]
        blocks = [(c0, min(c0 + cols, valid)) for c0 in range(0, valid, cols)]
        z_blocks = [logits[count * c0:count * c1].view(count, c1 - c0) for c0, c1 in blocks]
        if valid == 0:  # this rank holds only vocab padding: an empty piece
            m = torch.full((count,), float("-inf"), dtype=acc, device=device)
            s, u, label_logit = (torch.zeros(count, dtype=acc, device=device) for _ in range(3))
        for i, ((c0, c1), z) in enumerate(zip(blocks, z_blocks)):
            _logits_into(z, hidden_r, weight[c0:c1], inv_temp)
            stats_b = backend.block_stats(z, labels_r - c0)
            if i == 0:
                m, s, u, label_logit = stats_b
            else:
                label_logit = label_logit + stats_b[3]
                m, s, u = row_stats.merge_stats(m, s, u, *stats_b[:3])
        m, s, u, label_logit = row_stats.all_reduce_stats(m, s, u, label_logit, shard.group)
        lse, entropy, g_lp, g_ent = token_step(spec, results, r0, r1, m, s, u, label_logit, inv_temp)
        if not (need_hidden or need_weight) or valid == 0:
            if grad_h is not None:
                grad_h[r0:r1].zero_()
            continue
        # 16-bit: sum the blocks' d(hidden) in fp32, round once
        gh = None
        if need_hidden:
            gh = grad_h[r0:r1] if dtype == acc else torch.zeros(count, h, dtype=acc, device=device)
        for i, ((c0, c1), z) in enumerate(zip(blocks, z_blocks)):
            dz = backend.block_grad(z, labels_r - c0, lse, entropy, g_lp, g_ent, dtype)
            w_c = weight[c0:c1]
            if gh is not None:
                if dtype != acc:
                    gh += dz @ w_c
                elif i == 0:
                    torch.mm(dz, w_c, out=gh)
                else:
                    gh.addmm_(dz, w_c)
            if grad_w is not None:
                if r0 == 0:
                    torch.mm(dz.t(), hidden_r, out=grad_w[c0:c1])
                else:
                    grad_w[c0:c1].addmm_(dz.t(), hidden_r)
        if need_hidden and dtype != acc:
            grad_h[r0:r1] = gh
    if grad_h is not None and shard.group is not None:
        dist.all_reduce(grad_h, group=shard.group)
    loss, stats = results.finish(spec)
    return loss, stats, results.log_probs, results.entropy, grad_h, grad_w


class _FusedLinearPPOLoss(torch.autograd.Function):
    """Computes loss and gradients in forward; saves only the gradients (no logits, no statistics)."""

    @staticmethod
    def forward(ctx, hidden, weight, call):
        loss, stats, log_probs, entropy, grad_h, grad_w = call(ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(stats, log_probs, entropy)
        return loss, stats, log_probs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, *_unused):
        grad_h, grad_w = ctx.saved_tensors
        # in place: the stored gradients are used once (a second backward fails loudly on the version check)
        if grad_h is not None:
            grad_h = grad_h.mul_(g_loss.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(g_loss.to(grad_w.dtype))
        return grad_h, grad_w, None


def fused_ppo_loss(backend: ModuleType, token_step: Callable, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   spec: PPOTokenLoss, *, temperature: float, tp_group: Optional[dist.ProcessGroup],
                   valid_vocab_size: Optional[int], chunk_rows: Optional[int], block_cols: Optional[int]
                   ) -> FusedPPOLossOutput:
    """Run the fused loss with `backend`; see mppo.kernels.fused_linear_ppo_loss for the contract."""
    for name, value in (("chunk_rows", chunk_rows), ("block_cols", block_cols)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1 or None, got {value}")
    hidden, weight, labels_local, shard, inv_temp = prepare_inputs(hidden, weight, labels, temperature=temperature,
                                                                   tp_group=tp_group, chunk_size=None,
                                                                   valid_vocab_size=valid_vocab_size)
    spec.validate(hidden.shape[0])

    def call(need_hidden: bool, need_weight: bool):
        return _run(backend, token_step, hidden, weight, labels_local, shard, inv_temp, spec, chunk_rows, block_cols,
                    need_hidden, need_weight)

    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, stats, log_probs, entropy = _FusedLinearPPOLoss.apply(hidden, weight, call)
    else:  # evaluation only: no gradient pass
        loss, stats, log_probs, entropy, _, _ = call(False, False)
    return FusedPPOLossOutput(loss=loss, stats=stats, log_probs=log_probs, entropy=entropy)
