"""Triton backend of the fused kernels (CUDA; CPU under TRITON_INTERPRET=1).

Forward: one launch over (row blocks × vocab splits); each program walks its vocab split in BLOCK_V tiles, computes
the logits tile with tl.dot over BLOCK_H slices of H, and keeps the online row statistics (row_stats) in registers.
The per-split partial statistics ([splits, N], tiny) are merged in torch. Backward: per vocab chunk, one launch
recomputes the logits tile and writes dLoss/dz; the two gradient matmuls then run in torch (cuBLAS on GPU), so no
atomics and each grad_weight row is written once. The same two kernels run over logits the fused PPO loss has
already computed (FROM_LOGITS: `block_stats`, `block_grad`), so both ops share one implementation of the row math.

The dot always accumulates in fp32. fp32 inputs multiply in IEEE fp32 (not tf32: the log-probs feed an importance
ratio). 16-bit inputs multiply natively on the GPU's tensor cores; under the interpreter they are upcast right after
the load instead, because the interpreter handles bf16 as raw bits (exact either way: products of 8-bit mantissas).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from . import row_stats
from .fused_logprob import accumulation_dtype

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the interpreter, cost grows with programs × tile iterations: big tiles, few programs. On the GPU the tiles
# were chosen on an H200 (tests/gpu/tune_logprob_triton.py, bf16, N=16384, H=2048, V=151936, forward + backward):
# 64x256x64 with 4 warps 146 ms, 128x256x64/8 174 ms, 128x128x64/8 180 ms, the earlier 64x128x32/8 203 ms.
BLOCK_N, BLOCK_V, BLOCK_H = (64, 128, 64) if _INTERPRET else (64, 256, 64)
NUM_WARPS = 4


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                 DOT_IN_FP32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """z[BLOCK_N, BLOCK_V] = (h[rows] · w[cols]ᵀ) · inv_temp in fp32."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_ok = ks < H
        a = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
    return acc * inv_temp


@triton.jit
def _tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp, FROM_LOGITS: tl.constexpr,
          DOT_IN_FP32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    """A [BLOCK_N, BLOCK_V] tile of scaled logits in fp32: computed from hidden and weight, or (FROM_LOGITS)
    loaded from an fp32 logits buffer at h_ptr with row stride stride_h (the fused PPO loss computes its logits
    with cuBLAS once and runs these kernels over them)."""
    if FROM_LOGITS:
        z = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0)
    else:
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                         DOT_IN_FP32, BLOCK_N, BLOCK_V, BLOCK_H)
    return z


@triton.jit
def _stats_kernel(h_ptr, w_ptr, labels_ptr, m_ptr, s_ptr, u_ptr, label_logit_ptr,
                  N, V, H, cols_per_split, stride_h, stride_w, inv_temp,
                  COMPUTE_U: tl.constexpr, DOT_IN_FP32: tl.constexpr, FROM_LOGITS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_N], dtype=tl.float32)
    label_logit = tl.zeros([BLOCK_N], dtype=tl.float32)
    v_begin = split * cols_per_split
    v_end = tl.minimum(v_begin + cols_per_split, V)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
                  FROM_LOGITS, DOT_IN_FP32, BLOCK_N, BLOCK_V, BLOCK_H)
        is_label = (cols[None, :] == labels[:, None]) & col_ok[None, :]
        label_logit += tl.sum(tl.where(is_label, z, 0.0), axis=1)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))  # finite: every tile has a valid column
        # rescale the running (s, u) to the new max; the first tile has s == 0 and m == -inf (guarded)
        shift = tl.where(s > 0, m - m_new, 0.0)
        alpha = tl.exp(shift)
        u = alpha * (u + shift * s)
        s = alpha * s
        d = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_ok[None, :], tl.exp(d), 0.0)
        s += tl.sum(e, axis=1)
        if COMPUTE_U:
            u += tl.sum(e * d, axis=1)
        m = m_new
    out = split * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(u_ptr + out, u, mask=row_ok)
    tl.store(label_logit_ptr + out, label_logit, mask=row_ok)


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, labels_ptr, lse_ptr, entropy_ptr, g_lp_ptr, g_ent_ptr, grad_ptr,
                        N, V, H, stride_h, stride_w, stride_g, inv_temp,
                        HAS_G_LP: tl.constexpr, HAS_G_ENT: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                        FROM_LOGITS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    # FROM_LOGITS with grad_ptr == h_ptr overwrites the logits: each element is read and written by one program
    z = _tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_h, stride_w, inv_temp,
              FROM_LOGITS, DOT_IN_FP32, BLOCK_N, BLOCK_V, BLOCK_H)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    log_p = z - lse[:, None]
    p = tl.exp(log_p)
    grad = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    if HAS_G_ENT:
        entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        grad -= p * (g_ent[:, None] * (log_p + entropy[:, None]))
    if HAS_G_LP:
        g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        grad += g_lp[:, None] * (tl.where(cols[None, :] == labels[:, None], 1.0, 0.0) - p)
    tl.store(grad_ptr + rows[:, None] * stride_g + cols[None, :], grad, mask=row_ok[:, None] & col_ok[None, :])


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton backend supports bf16, fp16 and fp32 inputs, not {dtype} (use backend='torch')")
    return dtype == torch.float32 or _INTERPRET


def _default_cols_per_split(n_rows: int, n_cols: int, device: torch.device) -> int:
    """Split the vocab so the grid has a few programs per SM; one split under the interpreter (cheapest)."""
    if device.type != "cuda":
        return n_cols
    row_blocks = triton.cdiv(n_rows, BLOCK_N)
    target_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = max(1, min(triton.cdiv(n_cols, BLOCK_V), triton.cdiv(target_programs, row_blocks)))
    return triton.cdiv(triton.cdiv(n_cols, splits), BLOCK_V) * BLOCK_V


def local_stats(hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor, inv_temp: float,
                compute_entropy: bool, chunk_size: Optional[int]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics over all rows of `weight` (see logprob_torch.local_stats); chunk_size = columns per split."""
    dot_in_fp32 = _dot_in_fp32(hidden.dtype)
    n, v = hidden.shape[0], weight.shape[0]
    cols_per_split = chunk_size if chunk_size is not None else _default_cols_per_split(n, v, hidden.device)
    splits = triton.cdiv(v, cols_per_split)
    m, s, u, label_logit = (torch.empty(splits, n, dtype=torch.float32, device=hidden.device) for _ in range(4))
    grid = (triton.cdiv(n, BLOCK_N), splits)
    _stats_kernel[grid](hidden, weight, labels_local, m, s, u, label_logit,
                        n, v, hidden.shape[1], cols_per_split, hidden.stride(0), weight.stride(0), inv_temp,
                        COMPUTE_U=compute_entropy, DOT_IN_FP32=dot_in_fp32, FROM_LOGITS=False,
                        BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS)
    m, s, u = row_stats.merge_partials(m, s, u)
    return m, s, u, label_logit.sum(dim=0)


def grad_logits_chunk(hidden_r: torch.Tensor, weight_c: torch.Tensor, labels_c: torch.Tensor, lse_r: torch.Tensor,
                      entropy_r: Optional[torch.Tensor], g_lp_r: Optional[torch.Tensor],
                      g_ent_r: Optional[torch.Tensor], inv_temp: float) -> torch.Tensor:
    """dLoss/dz for one chunk in fp32 (see logprob_torch.grad_logits_chunk)."""
    n, v = hidden_r.shape[0], weight_c.shape[0]
    grad = torch.empty(n, v, dtype=accumulation_dtype(hidden_r.dtype), device=hidden_r.device)
    has_g_lp, has_g_ent = g_lp_r is not None, g_ent_r is not None
    dummy = lse_r  # never read when the matching HAS_* flag is off
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(v, BLOCK_V))
    _grad_logits_kernel[grid](hidden_r, weight_c, labels_c.contiguous(), lse_r.contiguous(),
                              entropy_r.contiguous() if has_g_ent else dummy,
                              g_lp_r.contiguous() if has_g_lp else dummy,
                              g_ent_r.contiguous() if has_g_ent else dummy, grad,
                              n, v, hidden_r.shape[1], hidden_r.stride(0), weight_c.stride(0), grad.stride(0),
                              inv_temp, HAS_G_LP=has_g_lp, HAS_G_ENT=has_g_ent,
                              DOT_IN_FP32=_dot_in_fp32(hidden_r.dtype), FROM_LOGITS=False,
                              BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS)
    return grad


def _check_logits(z: torch.Tensor) -> None:
    if z.dtype != torch.float32 or z.stride(1) != 1:
        raise TypeError(f"the Triton backend runs over fp32 logits with unit column stride (bf16/fp16/fp32 "
                        f"inputs), got {z.dtype} (use backend='torch' for fp64)")


def block_stats(z: torch.Tensor, labels_block: torch.Tensor, compute_entropy: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics of a block of computed logits (see logprob_torch.block_stats); z is not modified."""
    _check_logits(z)
    n, v = z.shape
    cols_per_split = _default_cols_per_split(n, v, z.device)
    splits = triton.cdiv(v, cols_per_split)
    m, s, u, label_logit = (torch.empty(splits, n, dtype=torch.float32, device=z.device) for _ in range(4))
    grid = (triton.cdiv(n, BLOCK_N), splits)
    _stats_kernel[grid](z, z, labels_block.contiguous(), m, s, u, label_logit,
                        n, v, 0, cols_per_split, z.stride(0), 0, 1.0,
                        COMPUTE_U=compute_entropy, DOT_IN_FP32=True, FROM_LOGITS=True,
                        BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS)
    m, s, u = row_stats.merge_partials(m, s, u)
    return m, s, u, label_logit.sum(dim=0)


def block_grad(z: torch.Tensor, labels_block: torch.Tensor, lse_r: torch.Tensor, entropy_r: Optional[torch.Tensor],
               g_lp_r: Optional[torch.Tensor], g_ent_r: Optional[torch.Tensor], out_dtype: torch.dtype
               ) -> torch.Tensor:
    """dLoss/dz of a block of computed logits, in `out_dtype` (see logprob_torch.block_grad). fp32 output
    overwrites z; 16-bit output goes to its own buffer on the GPU (stored rounded by the kernel) and through z
    under the interpreter (whose 16-bit stores truncate), then cast."""
    _check_logits(z)
    n, v = z.shape
    out = z if out_dtype == z.dtype or _INTERPRET else torch.empty(n, v, dtype=out_dtype, device=z.device)
    has_g_lp, has_g_ent = g_lp_r is not None, g_ent_r is not None
    dummy = lse_r  # never read when the matching HAS_* flag is off
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(v, BLOCK_V))
    _grad_logits_kernel[grid](z, z, labels_block.contiguous(), lse_r.contiguous(),
                              entropy_r.contiguous() if has_g_ent else dummy,
                              g_lp_r.contiguous() if has_g_lp else dummy,
                              g_ent_r.contiguous() if has_g_ent else dummy, out,
                              n, v, 0, z.stride(0), 0, out.stride(0), 1.0,
                              HAS_G_LP=has_g_lp, HAS_G_ENT=has_g_ent, DOT_IN_FP32=True, FROM_LOGITS=True,
                              BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS)
    return out if out.dtype == out_dtype else out.to(out_dtype)
