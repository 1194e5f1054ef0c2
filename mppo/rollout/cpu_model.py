"""A packed, batch-invariant forward over a transformers Llama-family model (Llama, Qwen2, Qwen3) with a KV cache.

Why not call the HF model with left padding: padding changes the floating point of every padded sequence
(attention reductions over a longer, shifted key axis), so a prompt gives last-bit different logits alone and in a
batch. Here sequences are PACKED (no padding): the row-wise layers (embedding, norms, linears, MLP, lm_head) run over
all tokens at once, and attention runs per sequence on that sequence's own, unpadded KV cache, so its shapes never
depend on the other sequences. The weights and sub-modules are the HF model's own; only the order of calls is here.

Batch invariance then rests on one property of the CPU GEMM: a row's result does not depend on the other rows.
torch's CPU BLAS gives that for >= 4 rows when single-threaded (measured: 1, 2-3 and >= 4 rows take three different
kernels), so every linear sees at least MIN_ROWS rows (zero rows are appended). With several intra-op threads the
BLAS splits rows across threads and small per-thread blocks take the other kernels: then results can differ in the
last bit with the batch, and only the sampled tokens stay the same (except at genuine near-ties; see sampling.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Every row-wise layer runs on at least this many rows: see the module docstring (>= 4 needed, 16 for margin).
MIN_ROWS = 16


class SequenceKV:
    """One sequence's KV cache: per layer a key and a value buffer [kv_heads, capacity, head_dim]."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], length: int = 0) -> None:
        self.keys = keys
        self.values = values
        self.length = length  # positions filled so far

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def clone(self) -> SequenceKV:
        return SequenceKV([k.clone() for k in self.keys], [v.clone() for v in self.values], self.length)


def check_supported(config) -> None:
    """Raise a clear error for architectures this forward does not reproduce exactly."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"The CPU rollout engine supports model_type in {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}"
        )
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("The CPU rollout engine supports full attention only; this config enables sliding windows")


class PackedCausalLM:
    """Runs `hf_model` (a *ForCausalLM from SUPPORTED_MODEL_TYPES) over packed sequences with per-sequence caches."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        check_supported(hf_model.config)
        self._model = hf_model
        attn = hf_model.model.layers[0].self_attn
        self.num_layers = len(hf_model.model.layers)
        self.head_dim = attn.head_dim
        self.kv_heads = hf_model.config.num_key_value_heads
        self.dtype = hf_model.model.embed_tokens.weight.dtype

    def new_sequence(self, capacity: int) -> SequenceKV:
        """An empty cache for a sequence of at most `capacity` tokens (prompt + generated)."""
        shape = (self.kv_heads, capacity, self.head_dim)
        keys = [torch.empty(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        values = [torch.empty(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        return SequenceKV(keys, values)

    @torch.no_grad()
    def forward(self, token_ids: list[list[int]], caches: list[SequenceKV]) -> torch.Tensor:
        """Append token_ids[i] to sequence i and return float32 logits after its last new token, [len(caches), V]."""
        # Torch-function modes (mppo.parallel.cpu_compat installs two, process-wide, for megatron on CPU) wrap every
        # torch call in Python; decoding makes thousands of small calls per token, and none of them needs the
        # modes (CPU tensors only), so they are switched off here. Results are unchanged: the modes only rewrite
        # CUDA arguments and tensor type names.
        with torch._C.DisableTorchFunction():
            return self._forward(token_ids, caches)

    def _forward(self, token_ids: list[list[int]], caches: list[SequenceKV]) -> torch.Tensor:
        lengths = [len(t) for t in token_ids]
        for cache, n in zip(caches, lengths, strict=True):
            if n == 0 or cache.length + n > cache.capacity:
                raise ValueError(f"cannot append {n} tokens to a sequence of {cache.length}/{cache.capacity}")
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        total = starts[-1] + lengths[-1]
        rows = max(total, MIN_ROWS)
        ids = torch.zeros(rows, dtype=torch.long)
        ids[:total] = torch.tensor([t for seq in token_ids for t in seq], dtype=torch.long)
        positions = torch.zeros(rows, dtype=torch.long)
        positions[:total] = torch.tensor([c.length + i for c, n in zip(caches, lengths) for i in range(n)])

        decoder = self._model.model
        hidden = decoder.embed_tokens(ids)
        cos, sin = decoder.rotary_emb(hidden[None], positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [rows, 1, head_dim]: broadcast over heads
        for layer_index, layer in enumerate(decoder.layers):
            attn_out = self._attention(layer, layer_index, hidden, cos, sin, caches, starts, lengths)
            hidden = hidden + attn_out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        for cache, n in zip(caches, lengths):
            cache.length += n

        last = torch.zeros(max(len(caches), MIN_ROWS), hidden.shape[-1], dtype=hidden.dtype)
        last[: len(caches)] = hidden[[s + n - 1 for s, n in zip(starts, lengths)]]
        logits = self._model.lm_head(decoder.norm(last))
        return logits[: len(caches)].float()

    def _attention(self, layer, layer_index, hidden, cos, sin, caches, starts, lengths) -> torch.Tensor:
        attn = layer.self_attn
        rows = hidden.shape[0]
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(rows, -1, self.head_dim)
        k = attn.k_proj(x).view(rows, -1, self.head_dim)
        v = attn.v_proj(x).view(rows, -1, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head before RoPE
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)

        # Head-major views [heads, rows, head_dim], made once: the loop below then slices them per sequence with
        # the same strides (and so the same numerics) as slicing and transposing each sequence's rows.
        q_heads, k_heads, v_heads = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out = torch.zeros_like(q)
        out_heads = out.transpose(0, 1)
        for cache, start, n in zip(caches, starts, lengths):
            end, past = start + n, cache.length
            k_cache, v_cache = cache.keys[layer_index], cache.values[layer_index]
            k_cache[:, past : past + n] = k_heads[:, start:end]
            v_cache[:, past : past + n] = v_heads[:, start:end]
            # Token i of the new block sees every cached position and new positions <= i.
            mask = None if n == 1 else torch.ones(n, past + n, dtype=torch.bool).tril(diagonal=past)
            out_heads[:, start:end] = F.scaled_dot_product_attention(
                q_heads[None, :, start:end],
                k_cache[None, :, : past + n],
                v_cache[None, :, : past + n],
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=True,
            )[0]
        return attn.o_proj(out.reshape(rows, -1))


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE on [rows, heads, head_dim] with cos/sin [rows, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
