"""Core attention over `torch.nn.functional.scaled_dot_product_attention` (SDPA), for megatron-core layer specs.

megatron-core's local `DotProductAttention` materialises the [b, heads, s, s] scores and probabilities (and keeps
them for the backward), which at 4k-32k-token sequences is the memory wall. SDPA dispatches to a fused kernel
that never does: FlashAttention-2 / memory-efficient / cuDNN on CUDA, the flash CPU kernel on CPU, all with
O(s) extra memory. `SDPAttention` is a drop-in `core_attention` for megatron's `SelfAttention`: it takes
megatron's tensors ([s, b, heads, head_dim], this TP rank's heads only: `SelfAttention` has already split the
heads over TP, so nothing here communicates) and returns [s, b, heads * head_dim] like DotProductAttention.

Masks follow megatron: `attention_mask` is boolean with True = masked out, broadcastable to [b, heads, sq, sk].
No mask and a causal layer (what mppo passes: right-padded rows, positions 0..s-1) is SDPA's `is_causal`. A causal
layer given a mask applies the causal mask too. A query whose keys are all masked attends uniformly to every key
and passes no gradient to queries and keys, exactly as megatron's constant fill of masked scores makes it (SDPA
alone would give NaN).
Grouped-query attention uses SDPA's `enable_gqa` (no repeated K/V copies) where the kernel takes it; on CUDA, where
only the fp16/bf16 flash kernel does, other inputs (fp32, a mask) get K/V repeated to the query heads so that the
memory-efficient or cuDNN kernel runs instead of the math one (`kv_for_fused_kernel`).

Context parallelism (CP > 1): each rank holds 2 of the sequence's 2·CP load-balanced chunks (chunks r and
2·CP-1-r, `mppo.parallel.context_parallel`; megatron's split, which its RotaryEmbedding applies to the rotary
angles too, so positions are right without position ids). K and V are all-gathered over the CP group into natural
order and the backward reduce-scatters dK/dV (`gather_for_cp`); each local query chunk j then attends to the keys
up to its own end, (j+1)·s/(2·CP), with lower-right causal alignment (torch's `causal_lower_right`).
Why an all-gather and not a ring (ring attention passing K/V blocks round the CP ranks): with grouped-query
attention K/V are a fraction of the activations (Qwen2.5-7B: 4 of 28 heads), so gathering them whole costs little
memory (2·s·groups·head_dim per layer, kept for the backward) and one collective per layer instead of CP-1 steps
whose overlap needs streams; the masks stay exact and simple (a prefix of the keys plus the diagonal block), with
no partial softmaxes passed between ranks. Llama 3's training and megatron's `all_gather`
cp_comm_type make the same choice. The cost is that the K/V all-gather is not overlapped with compute.
On CUDA the flash / memory-efficient kernels take the lower-right mask without materialising it. The CPU kernel
would materialise it ([queries, keys] booleans, then float copies, which its backward keeps), so on CPU a chunk
is two flash calls instead, the keys before the chunk unmasked and the chunk's own keys square-causal, merged by
their log-sum-exps (`_PrefixCausalAttention`). Measured on one 32k-token sequence (`mppo bench long-context`,
bench/RESULTS.md section 14): with masked query blocks the CP2 update needed 2.06x CP1's memory, with the split
0.55x (CP4: 0.31x).
Under CP only causal (or unmasked) attention without an explicit mask is covered, which is what mppo passes.
With `transformer_impl=te` Transformer Engine's own CP runs instead (cp_comm_type from the TransformerConfig,
mppo.models.builders sets all_gather); that path needs CUDA and is not exercised by the CPU tests.

Not covered (each raises): packed THD sequences (`packed_seq_params`), attention bias, sliding windows, non-vanilla
softmax, explicit masks under context parallelism. Those need Transformer Engine's attention (`transformer_impl=te`).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.bias import causal_lower_right
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from mppo.parallel.context_parallel import gather_for_cp

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                 dropout_p: float = 0.0, is_causal: bool = False) -> SDPBackend:
    """The kernel torch SDPA dispatches these [b, h, s, d] inputs to (K/V with fewer heads: grouped-query)."""
    choice = torch._fused_sdp_choice(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                     enable_gqa=k.shape[1] != q.shape[1])
    return SDPBackend(choice)


def kv_for_fused_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
                        dropout_p: float, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as SDPA should get them: grouped as they are, or repeated to the query heads when only that lets a
    fused kernel run. On CUDA only the flash kernel takes grouped K/V, and only in fp16/bf16 without a mask; fp32
    (or a mask) would fall to the math kernel, which materialises [b, h, sq, sk] scores, while repeated K/V
    (O(s) extra memory) let the memory-efficient or cuDNN kernel run. The CPU flash kernel takes grouped K/V,
    masks and fp32 as they are."""
    heads = q.shape[1]
    if k.shape[1] == heads or not q.is_cuda or sdpa_backend(q, k, v, attn_mask, dropout_p,
                                                               is_causal) != SDPBackend.MATH:
        return k, v
    repeated = [t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v)]
    if sdpa_backend(q, *repeated, attn_mask, dropout_p, is_causal) == SDPBackend.MATH:
        return k, v  # math either way: the grouped tensors are smaller
    return repeated[0], repeated[1]


class _PrefixCausalAttention(torch.autograd.Function):
    """CPU: `rows` queries at natural positions start.. against keys 0..start+rows-1, lower-right causal, as two
    flash-kernel calls: the keys before the chunk (no mask) and the chunk's own keys (square causal), merged by their
    log-sum-exps. The backward runs the flash backward of each part against the merged output and log-sum-exp
    (what ring attention does per step), which gives each part's exact share of dQ and its dK/dV. No mask is
    materialised and nothing is recomputed; saved are q, k, v (views), the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                scale: Optional[float]) -> torch.Tensor:
        before, before_lse = _cpu_flash(q, k[:, :, :start], v[:, :, :start], False, scale)
        own, own_lse = _cpu_flash(q, k[:, :, start:], v[:, :, start:], True, scale)
        lse = torch.logaddexp(before_lse, own_lse)
        out = (torch.exp(before_lse - lse).unsqueeze(-1) * before + torch.exp(own_lse - lse).unsqueeze(-1) * own)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.start, ctx.scale = start, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        s, grad_out = ctx.start, grad_out.contiguous()
        dq_before, dk_before, dv_before = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k[:, :, :s], v[:, :, :s], out, lse, 0.0, False, scale=ctx.scale)
        dq_own, dk_own, dv_own = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k[:, :, s:], v[:, :, s:], out, lse, 0.0, True, scale=ctx.scale)
        return (dq_before + dq_own, torch.cat([dk_before, dk_own], dim=2), torch.cat([dv_before, dv_own], dim=2),
                None, None)


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
               scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash kernel (grouped K/V taken as they are): output [b, h, s, d] and log-sum-exp [b, h, s]."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return out, lse


class SDPAttention(MegatronModule):
    """Megatron's core-attention interface (the DotProductAttention / TEDotProductAttention constructor and
    forward signatures) computed with torch SDPA. It has no parameters, so checkpoints are the same as with
    DotProductAttention."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        if config.softmax_type != "vanilla":
            raise NotImplementedError(f"SDPA attention has no softmax_type={config.softmax_type!r}; "
                                      "use transformer_impl=te or local")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError("SDPA attention has no sliding-window attention; use transformer_impl=te")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp  # MegatronModule.sharded_state_dict reads it
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies it back inside
        # megatron's fp32 softmax: the same product, so SDPA takes the plain scale.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] (ng divides np) -> context [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise NotImplementedError("SDPA attention takes padded [s, b] batches, not packed sequences; "
                                      "use transformer_impl=te for packed (THD) inputs")
        if attention_bias is not None:
            raise NotImplementedError("SDPA attention takes no attention bias; use transformer_impl=te")
        sq, b, heads, head_dim = query.shape
        sk = key.shape[0]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, attention_mask, mask_type in _CAUSAL_TYPES)
        causal = mask_type in _CAUSAL_TYPES and sq > 1  # sq == 1: one query against a KV cache sees all keys
        if causal and sq != sk:
            raise ValueError(f"causal SDPA attention needs as many queries as keys, got {sq} and {sk}")
        # [s, b, h, d] -> [b, h, s, d] views; SDPA takes strided inputs
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        keep = None
        if attention_mask is not None:
            keep = ~attention_mask.to(torch.bool)
            if causal:
                keep = keep & torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()
                causal = False
            # A query with every key masked: megatron fills its scores with a constant, so it attends uniformly
            # and passes no gradient to q or k. A zero query against every key is exactly that.
            empty = ~keep.any(dim=-1, keepdim=True)
            keep = keep | empty
            q = q.masked_fill(empty, 0.0)
        dropout_p = self.dropout_p if self.training else 0.0
        k, v = kv_for_fused_kernel(q, k, v, keep, dropout_p, causal)
        # dropout off draws no random numbers: no need to fork the model-parallel RNG
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=k.shape[1] != heads)
        # [b, h, sq, d] -> [sq, b, h * d]
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)

    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
        """This rank's two query chunks against the CP-gathered keys (see the module docstring)."""
        if attention_mask is not None:
            raise NotImplementedError("SDPA attention under context parallelism takes no explicit mask (mppo passes "
                                      "none: right-padded rows, causal layers); use transformer_impl=te")
        if query.shape[0] != key.shape[0]:
            raise ValueError(f"context-parallel attention needs as many local queries as keys, got {query.shape[0]} "
                             f"and {key.shape[0]}")
        sq, b, heads, head_dim = query.shape
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        chunk = sq // 2
        # [s, b, g, d] in natural order -> [b, g, s, d]
        k, v = (gather_for_cp(t, self.cp_group).permute(1, 2, 0, 3) for t in (key, value))
        q = query.permute(1, 2, 0, 3)
        dropout_p = self.dropout_p if self.training else 0.0
        outs = []
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext():
            for i, j in enumerate((rank, 2 * cp - 1 - rank)):  # local chunk i is natural chunk j
                q_chunk = q[:, :, i * chunk:(i + 1) * chunk]
                if causal:
                    outs.append(self._causal_chunk(q_chunk, k, v, j * chunk, dropout_p))
                else:
                    outs.append(self._sdpa(q_chunk, k, v, None, dropout_p, False))
        # [b, h, sq, d] -> [sq, b, h * d]
        return torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)

    def _causal_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                      dropout_p: float) -> torch.Tensor:
        """Queries at natural positions start.. against keys 0..(their position): lower-right causal attention."""
        rows = q.shape[2]
        end = start + rows
        if start == 0:  # the first chunk: square, plain causal
            return self._sdpa(q, k[:, :, :rows], v[:, :, :rows], None, dropout_p, True)
        if q.is_cuda:  # the flash / memory-efficient kernels take the lower-right mask without materialising it
            return self._sdpa(q, k[:, :, :end], v[:, :, :end], causal_lower_right(rows, end), dropout_p, False)
        if dropout_p > 0.0:
            raise NotImplementedError("attention dropout under context parallelism runs on CUDA only (the CPU path "
                                      "merges two flash calls, which take no dropout); set the model's "
                                      "attention_dropout to 0 or run on GPUs")
        return _PrefixCausalAttention.apply(q, k[:, :, :end], v[:, :, :end], start, self.softmax_scale)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, dropout_p: float,
              is_causal: bool) -> torch.Tensor:
        # the kernel constraints of a lower-right causal mask are those of is_causal (no mask tensor)
        k, v = kv_for_fused_kernel(q, k, v, None, dropout_p, is_causal or mask is not None)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
