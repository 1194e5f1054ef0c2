"""Backend-independent half of the fused hidden→log-prob/entropy op: validation, vocab sharding, TP combine, autograd.

A backend (logprob_torch, logprob_triton) supplies two functions:
  * `local_stats(hidden, weight, labels_local, inv_temp, compute_entropy, chunk_size)` → (m, s, u, label_logit), the
    row statistics (see row_stats) over this rank's valid vocab columns, never holding more than a chunk of logits;
  * `grad_logits_chunk(hidden_r, weight_c, labels_c, lse_r, entropy_r, g_lp_r, g_ent_r, inv_temp)` → fp32 gradient
    of the loss w.r.t. one chunk of temperature-scaled logits z = (h·Wᵀ)/T, recomputed from the saved statistics.
Everything else — the chunk loop of the backward matmuls, the TP all-reduces, the autograd plumbing — lives here,
once, so the two backends cannot drift apart.

Gradient of one row w.r.t. its scaled logits z (p = softmax(z), y = label, H = entropy):
    ∂log p_y/∂z_j = δ_jy − p_j,      ∂H/∂z_j = −p_j (log p_j + H)
so  dz_j = g_lp (δ_jy − p_j) − g_ent p_j (log p_j + H), and log p_j = z_j − lse needs only lse and H per row.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
import torch.distributed as dist

from . import row_stats

# Elements of one [rows × vocab-columns] chunk of logits (fp32: 16 MiB). Each chunk lives in 2–3 buffers at once;
# measured on CPU (mppo bench kernels) this size was as fast as larger ones while keeping the chunks in cache-ish
# sizes, and a small fraction of the naive path's [N × V] tensors.
CHUNK_ELEMENTS = 1 << 22
MAX_CHUNK_ROWS = 4096
MIN_CHUNK_COLS = 128


def plan_chunks(n_rows: int, n_cols: int, chunk_size: Optional[int]) -> tuple[int, int]:
    """(rows, vocab columns) per chunk. `chunk_size` (vocab columns) overrides the column count."""
    rows = max(1, min(n_rows, MAX_CHUNK_ROWS))
    cols = chunk_size if chunk_size is not None else max(MIN_CHUNK_COLS, CHUNK_ELEMENTS // rows)
    return rows, max(1, min(cols, max(n_cols, 1)))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 statistics for 16/32-bit inputs; fp64 inputs (tests) keep fp64."""
    return torch.promote_types(dtype, torch.float32)


class _Shard:
    """Where this rank's weight rows sit in the global vocabulary, and how many of them are real (not padding)."""

    def __init__(self, local_vocab: int, valid_vocab_size: Optional[int], tp_group: Optional[dist.ProcessGroup]):
        self.group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        rank = dist.get_rank(self.group) if self.group is not None else 0
        world = dist.get_world_size(self.group) if self.group is not None else 1
        self.global_vocab = local_vocab * world
        self.valid_vocab = self.global_vocab if valid_vocab_size is None else valid_vocab_size
        if not 0 < self.valid_vocab <= self.global_vocab:
            raise ValueError(f"valid_vocab_size={valid_vocab_size} must be in [1, {self.global_vocab}] "
                             f"(weight has {local_vocab} rows × {world} TP ranks)")
        self.start = rank * local_vocab
        self.local_valid = max(0, min(local_vocab, self.valid_vocab - self.start))

    def local_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Labels as row indices into this rank's valid weight rows; -1 where another rank owns the label."""
        local = labels.long() - self.start
        owned = (local >= 0) & (local < self.local_valid)
        return torch.where(owned, local, torch.full_like(local, -1))


def _forward(backend: ModuleType, hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor,
             shard: _Shard, inv_temp: float, compute_entropy: bool, chunk_size: Optional[int]):
    acc = accumulation_dtype(hidden.dtype)
    n = hidden.shape[0]
    if shard.local_valid > 0 and n > 0:
        m, s, u, label_logit = backend.local_stats(hidden, weight[: shard.local_valid], labels_local, inv_temp,
                                                   compute_entropy, chunk_size)
    else:  # this rank holds only vocab padding: an empty piece
        m = torch.full((n,), float("-inf"), dtype=acc, device=hidden.device)
        s, u, label_logit = (torch.zeros(n, dtype=acc, device=hidden.device) for _ in range(3))
    m, s, u, label_logit = row_stats.all_reduce_stats(m, s, u, label_logit, shard.group)
    return row_stats.finalize(m, s, u, label_logit)


def _backward(backend: ModuleType, hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor,
              lse: torch.Tensor, entropy: Optional[torch.Tensor], g_lp: Optional[torch.Tensor],
              g_ent: Optional[torch.Tensor], shard: _Shard, inv_temp: float, chunk_size: Optional[int],
              need_hidden: bool, need_weight: bool):
    """(grad_hidden, grad_weight). Rows whose outputs get no gradient (padding, prompt tokens, masked responses)
    contribute nothing, so only the others are recomputed — at the cost of one host sync to find them."""
    grads = [g != 0 for g in (g_lp, g_ent) if g is not None]
    rows = (grads[0] | grads[1] if len(grads) == 2 else grads[0]).nonzero().squeeze(1)
    if rows.numel() == hidden.shape[0]:
        grad_h, grad_w = _backward_rows(backend, hidden, weight, labels_local, lse, entropy, g_lp, g_ent, shard,
                                        inv_temp, chunk_size, need_hidden, need_weight)
    else:
        def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.index_select(0, rows)
        grad_h_rows, grad_w = _backward_rows(backend, pick(hidden), weight, pick(labels_local), pick(lse),
                                             pick(entropy), pick(g_lp), pick(g_ent), shard, inv_temp, chunk_size,
                                             need_hidden, need_weight)
        grad_h = None
        if grad_h_rows is not None:
            grad_h = grad_h_rows.new_zeros(hidden.shape)
            grad_h.index_copy_(0, rows, grad_h_rows)
    if grad_h is not None:
        if shard.group is not None:  # hidden is replicated across TP: sum the vocab shards' contributions
            dist.all_reduce(grad_h, group=shard.group)
        grad_h = grad_h.to(hidden.dtype)
    return grad_h, grad_w


def _backward_rows(backend: ModuleType, hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor,
                   lse: torch.Tensor, entropy: Optional[torch.Tensor], g_lp: Optional[torch.Tensor],
                   g_ent: Optional[torch.Tensor], shard: _Shard, inv_temp: float, chunk_size: Optional[int],
                   need_hidden: bool, need_weight: bool):
    """Chunked backward over the given rows; grad_hidden in the accumulation dtype, not yet TP-reduced."""
    acc = accumulation_dtype(hidden.dtype)
    n, valid = hidden.shape[0], shard.local_valid
    grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_hidden else None
    written = valid if n > 0 else 0  # weight rows the chunk loop writes; the rest (vocab padding) get zeros
    grad_w = None
    if need_weight:
        grad_w = torch.empty_like(weight)
        grad_w[written:].zero_()
    rows, cols = plan_chunks(n, valid, chunk_size)
    same_dtype = weight.dtype == acc  # fp32/fp64: matmuls accumulate straight into the gradients
    for c0 in range(0, written, cols):
        c1 = min(c0 + cols, valid)
        w_c = weight[c0:c1]
        # 16-bit weights: sum the row chunks' grad_weight in fp32, round once
        gw_acc = None if same_dtype or grad_w is None else torch.zeros(c1 - c0, weight.shape[1], dtype=acc,
                                                                        device=weight.device)
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            dz = backend.grad_logits_chunk(
                hidden[r0:r1], w_c, labels_local[r0:r1] - c0, lse[r0:r1],
                None if entropy is None else entropy[r0:r1],
                None if g_lp is None else g_lp[r0:r1], None if g_ent is None else g_ent[r0:r1], inv_temp)
            dz = dz.to(weight.dtype)  # no-op for fp32; 16-bit inputs use the fast 16-bit matmul
            if grad_h is not None:
                if same_dtype:
                    grad_h[r0:r1].addmm_(dz, w_c)
                else:
                    grad_h[r0:r1] += dz @ w_c
            if grad_w is None:
                continue
            if gw_acc is not None:
                gw_acc += dz.t() @ hidden[r0:r1]
            elif r0 == 0:
                torch.mm(dz.t(), hidden[r0:r1], out=grad_w[c0:c1])
            else:
                grad_w[c0:c1].addmm_(dz.t(), hidden[r0:r1])
        if grad_w is not None:
            if gw_acc is not None:
                grad_w[c0:c1] = gw_acc.mul_(inv_temp)
            elif inv_temp != 1.0:
                grad_w[c0:c1].mul_(inv_temp)
    if grad_h is not None:
        grad_h.mul_(inv_temp)
    return grad_h, grad_w


class _FusedLinearLogprob(torch.autograd.Function):
    """Saves hidden, weight, local labels and two O(N) statistics (lse, entropy); no [N × V] tensor survives."""

    @staticmethod
    def forward(ctx, hidden, weight, labels_local, backend, shard, inv_temp, compute_entropy, chunk_size):
        log_probs, entropy, lse = _forward(backend, hidden, weight, labels_local, shard, inv_temp,
                                           compute_entropy, chunk_size)
        ctx.backend, ctx.shard, ctx.inv_temp, ctx.chunk_size = backend, shard, inv_temp, chunk_size
        ctx.compute_entropy = compute_entropy
        ctx.set_materialize_grads(False)  # an unused output (e.g. entropy with entropy_coeff 0) costs nothing
        if compute_entropy:
            ctx.save_for_backward(hidden, weight, labels_local, lse, entropy)
            return log_probs, entropy
        ctx.save_for_backward(hidden, weight, labels_local, lse)
        return log_probs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent=None):
        if ctx.compute_entropy:
            hidden, weight, labels_local, lse, entropy = ctx.saved_tensors
        else:
            (hidden, weight, labels_local, lse), entropy = ctx.saved_tensors, None
        if g_lp is None and g_ent is None:
            return (None,) * 8
        acc = lse.dtype
        g_lp = None if g_lp is None else g_lp.to(acc)
        g_ent = None if g_ent is None else g_ent.to(acc)
        grad_h, grad_w = _backward(ctx.backend, hidden, weight, labels_local, lse, entropy, g_lp, g_ent, ctx.shard,
                                   ctx.inv_temp, ctx.chunk_size, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_h, grad_w, None, None, None, None, None, None


def _validate(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
              chunk_size: Optional[int]) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(f"expected hidden [N, H], weight [V_local, H], labels [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(labels.shape)} (flatten batch and sequence dims first)")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"labels {tuple(labels.shape)}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share one floating dtype; got {hidden.dtype} and {weight.dtype}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be int64 or int32 token ids, got {labels.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"hidden, weight and labels must be on one device; got {hidden.device}, {weight.device}, "
                         f"{labels.device}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size (vocab columns per chunk) must be >= 1 or None, got {chunk_size}")


def prepare_inputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float,
                   tp_group: Optional[dist.ProcessGroup], chunk_size: Optional[int],
                   valid_vocab_size: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Shard, float]:
    """Validated (hidden, weight, labels local to this rank's shard, shard, 1/temperature); shared by the
    fused kernels."""
    _validate(hidden, weight, labels, temperature, chunk_size)
    shard = _Shard(weight.shape[0], valid_vocab_size, tp_group)
    if labels.numel() and bool(((labels < 0) | (labels >= shard.valid_vocab)).any()):
        raise ValueError(f"labels must be global token ids in [0, {shard.valid_vocab}); got min "
                         f"{int(labels.min())}, max {int(labels.max())}")
    return hidden.contiguous(), weight.contiguous(), shard.local_labels(labels), shard, 1.0 / float(temperature)


def fused_logprob(backend: ModuleType, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                  temperature: float, tp_group: Optional[dist.ProcessGroup], chunk_size: Optional[int],
                  compute_entropy: bool, valid_vocab_size: Optional[int]
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run the fused op with `backend`; see mppo.kernels.fused_linear_logprob_entropy for the contract."""
    hidden, weight, labels_local, shard, inv_temp = prepare_inputs(hidden, weight, labels, temperature=temperature,
                                                                   tp_group=tp_group, chunk_size=chunk_size,
                                                                   valid_vocab_size=valid_vocab_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out = _FusedLinearLogprob.apply(hidden, weight, labels_local, backend, shard, inv_temp, compute_entropy,
                                        chunk_size)
        return out if compute_entropy else (out, None)
    # Forward only (old / reference log-probs): nothing is saved, no graph is built.
    log_probs, entropy, _ = _forward(backend, hidden, weight, labels_local, shard, inv_temp, compute_entropy,
                                     chunk_size)
    return log_probs, entropy if compute_entropy else None
