"""A batch-invariant forward over a transformers Llama-family model (Llama, Qwen2, Qwen3, Qwen3-MoE): prompt prefill and
batched decode steps over a preallocated KV cache (mppo.rollout.cpu_attention).

Why not call the HF model with left padding: padding changes the floating point of every padded sequence
(attention reductions over a longer, shifted key axis), so a prompt gives last-bit different logits alone and in
a batch. Here the row-wise layers (embedding, norms, linears, MLP, lm_head) run over all rows at once (packed
prompt tokens in prefill, one row per sample in decode), and attention is arranged so that its shapes and
reduction orders never depend on the other sequences (see cpu_attention). The weights are the HF model's own
Parameters (update_weights swaps their storage); the layers here call torch functionals on them, the same math
as the HF modules without their per-call module overhead.

Batch invariance of the row-wise layers rests on two properties of torch on CPU, single-threaded, which
tests/test_rollout_cpu_engine.py checks on the machine it runs on: a GEMM row's result does not depend on the
other rows (measured: 1, 2-3 and >= 4 rows take three different kernels, so every product sees at least
MIN_ROWS rows), and the elementwise ops used give an element the same bits wherever it sits in the tensor. The
second holds for exact IEEE ops and for exp, log and cos (their vectorised loops handle the tail with a partial
vector), but not for silu or sigmoid, whose scalar tail code (std::exp) can differ in the last bit from the
vector code: so SiLU is computed here as x / (1 + exp(-x)). With several intra-op threads, BLAS and elementwise
kernels split work by thread and results could depend on the batch: the engine instead runs one single-threaded
worker per thread on its own share of the prompts (mppo.rollout.cpu_decode), so results stay bitwise the same.

Layers are small classes, one per architecture feature (DecoderLayer = norm -> Attention -> norm -> MLP), so an
architecture with another MLP (MoE) or attention variant swaps one part.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mppo.rollout.cpu_attention import (
    DecodeLayout,
    PromptKV,
    SampleKV,
    decode_attention,
    prefill_attention,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Every batch has at least this many rows (>= 4 needed, see the module docstring; 16 for margin).
MIN_ROWS = 16


def check_supported(config) -> None:
    """Raise a clear error for architectures this forward does not reproduce exactly."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"The CPU rollout engine supports model_type in {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}"
        )
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"The CPU rollout engine supports the SiLU MLP activation only, got {config.hidden_act!r}")
    layer_types = getattr(config, "layer_types", None) or ()
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError("The CPU rollout engine supports full attention only; this config enables sliding windows")


class RMSNorm:
    """HF's Llama/Qwen RMSNorm (fp32 weights: weight * x / sqrt(mean(x^2) + eps)) as one fused torch call."""

    def __init__(self, hf_norm: torch.nn.Module) -> None:
        self.weight = hf_norm.weight  # the Parameter itself: update_weights may swap its storage
        self.eps = hf_norm.variance_epsilon

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def _linear(hf_linear: torch.nn.Linear) -> tuple[torch.nn.Parameter, torch.nn.Parameter | None]:
    return hf_linear.weight, hf_linear.bias


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) from ops whose results do not depend on an element's position (F.silu's do, see the module
    docstring); equal to F.silu within an ulp."""
    return x / torch.exp(-x).add_(1.0)


class GatedMLP:
    """down(act(gate(x)) * up(x)): Llama, Qwen2, Qwen3 dense MLPs (biases where the config has them)."""

    def __init__(self, hf_mlp: torch.nn.Module) -> None:
        self.gate, self.up, self.down = _linear(hf_mlp.gate_proj), _linear(hf_mlp.up_proj), _linear(hf_mlp.down_proj)

    def __call__(self, x: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        # the activation is SiLU (check_supported); a dense MLP has no routes to record
        return F.linear(silu(F.linear(x, *self.gate)) * F.linear(x, *self.up), *self.down)


class MoEMLP:
    """Qwen3-MoE's sparse block: a softmax router over all experts (fp32), the top-k weights (renormalised with
    norm_topk_prob), and the weighted sum of the chosen experts' gated MLPs, in ascending expert order as HF adds them.

    Every expert runs on every row and unchosen experts get weight 0 (adding 0 x y is exact): an expert's GEMM then
    never depends on which other tokens chose it, which keeps the forward batch-invariant, at num_experts / top_k
    times the MLP work of a sparse dispatch (the CPU engine serves tiny models).
    """

    def __init__(self, hf_moe: torch.nn.Module) -> None:
        router, experts = hf_moe.gate, hf_moe.experts
        self.router = router.weight
        self.top_k, self.norm_topk_prob = router.top_k, router.norm_topk_prob
        self.gate_up, self.down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]

    def __call__(self, x: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """`routes`: when given, this layer's chosen experts [rows, top_k] are appended to it (routing replay)."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, self.top_k, dim=-1)
        if routes is not None:
            routes.append(top_experts)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        weights = torch.zeros_like(probs).scatter_(1, top_experts, top_weights).to(x.dtype)  # [rows, E]
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            out += F.linear(silu(gate) * up, self.down[e]) * weights[:, e, None]
        return out


class Rope:
    """HF's rotate-half RoPE from a table of cos/sin by position (one table per generate() call)."""

    def __init__(self, hf_rotary: torch.nn.Module, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        cos, sin = hf_rotary(torch.zeros(1, max_positions, head_dim, dtype=dtype), torch.arange(max_positions)[None])
        half = head_dim // 2
        self.cos = cos[0]
        # rotate_half(x) * sin = cat(-x2, x1) * sin = cat(x2, x1) * cat(-sin1, sin2): the same products, bit for bit
        self.signed_sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for rows at `positions`, [rows, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions][:, None, :], self.signed_sin[positions][:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # roll by half a head = cat(x2, x1): pure data movement
        return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class Attention:
    """Grouped-query self-attention with RoPE (and Qwen3's per-head q/k RMSNorm), from an HF attention module."""

    def __init__(self, hf_attention: torch.nn.Module) -> None:
        self.q, self.k, self.v = (_linear(hf_attention.q_proj), _linear(hf_attention.k_proj),
                                  _linear(hf_attention.v_proj))
        self.o = _linear(hf_attention.o_proj)
        self.head_dim = hf_attention.head_dim
        self.scale = hf_attention.scaling
        has_qk_norm = hasattr(hf_attention, "q_norm")
        self.q_norm = RMSNorm(hf_attention.q_norm) if has_qk_norm else None
        self.k_norm = RMSNorm(hf_attention.k_norm) if has_qk_norm else None

    def _project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        rows = x.shape[0]
        q = F.linear(x, *self.q).view(rows, -1, self.head_dim)
        k = F.linear(x, *self.k).view(rows, -1, self.head_dim)
        v = F.linear(x, *self.v).view(rows, -1, self.head_dim)
        if self.q_norm is not None:  # Qwen3 normalises q and k per head before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        heads = q.shape[1]
        qk = Rope.apply(torch.cat((q, k), dim=1), *cos_sin)  # one RoPE for the query and key heads
        return qk[:, :heads], qk[:, heads:], v

    def prefill(self, x, cos_sin, layer: int, cache: PromptKV, starts: list[int]) -> torch.Tensor:
        q, k, v = self._project(x, cos_sin)
        out = prefill_attention(q, k, v, self.scale, cache, layer, starts)
        return F.linear(out.view(x.shape[0], -1), *self.o)

    def decode(self, x, cos_sin, layer: int, prompts: PromptKV, samples: SampleKV, step: int,
               layout: DecodeLayout) -> torch.Tensor:
        q, k, v = (layout.to_slots(t) for t in self._project(x, cos_sin))  # batch rows -> attention slots
        out = layout.to_rows(decode_attention(q, k, v, self.scale, prompts, samples, layer, step, layout.n))
        return F.linear(out.reshape(x.shape[0], -1), *self.o)


class DecoderLayer:
    """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, hf_layer: torch.nn.Module) -> None:
        self.input_norm = RMSNorm(hf_layer.input_layernorm)
        self.attention = Attention(hf_layer.self_attn)
        self.post_attention_norm = RMSNorm(hf_layer.post_attention_layernorm)
        self.mlp = MoEMLP(hf_layer.mlp) if hasattr(hf_layer.mlp, "experts") else GatedMLP(hf_layer.mlp)

    def feed_forward(self, hidden: torch.Tensor, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_norm(hidden), routes)


class PackedCausalLM:
    """Runs `hf_model` (a *ForCausalLM from SUPPORTED_MODEL_TYPES): prefill of packed prompts, then decode steps."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        check_supported(hf_model.config)
        self._model = hf_model
        self.layers = [DecoderLayer(layer) for layer in hf_model.model.layers]
        attn = hf_model.model.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.kv_heads = hf_model.config.num_key_value_heads
        self.dtype = hf_model.model.embed_tokens.weight.dtype
        self.embedding = hf_model.model.embed_tokens.weight
        self.final_norm = RMSNorm(hf_model.model.norm)
        self.lm_head = hf_model.lm_head.weight  # tied models share the embedding Parameter here
        self.moe_layers = sum(isinstance(layer.mlp, MoEMLP) for layer in self.layers)
        self.top_k = next((layer.mlp.top_k for layer in self.layers if isinstance(layer.mlp, MoEMLP)), 0)

    # ---- caches and RoPE ----------------------------------------------------------------------------------
    def allocate_prompts(self, lengths: list[int]) -> PromptKV:
        return PromptKV.allocate(lengths, len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def allocate_samples(self, prompts: int, n: int, capacity: int) -> SampleKV:
        return SampleKV.allocate(prompts, n, capacity, len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def rope(self, max_positions: int) -> Rope:
        """RoPE for positions 0..max_positions-1 (read-only: workers share it)."""
        with torch._C.DisableTorchFunction():
            return Rope(self._model.model.rotary_emb, self.head_dim, max_positions, self.dtype)

    # ---- forward ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: PromptKV, rope: Rope,
                routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Run the packed prompts, filling `cache`; float32 logits after each prompt's last token, [prompts, V].
        `routes`: when given, each MoE layer appends its chosen experts [packed rows, top_k] (prompts back to back
        from row 0, then padding rows)."""
        # Torch-function modes (mppo.parallel.cpu_compat installs two, process-wide, for megatron on CPU) wrap every
        # torch call in Python; decoding makes thousands of small calls, and none of them needs the modes (CPU
        # tensors only), so they are switched off here. Results are unchanged: the modes only rewrite CUDA
        # arguments and tensor type names.
        with torch._C.DisableTorchFunction():
            lengths = [len(p) for p in prompts]
            starts = [0]
            for n in lengths[:-1]:
                starts.append(starts[-1] + n)
            total = starts[-1] + lengths[-1]
            rows = max(total, MIN_ROWS)
            ids = torch.zeros(rows, dtype=torch.long)
            ids[:total] = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
            positions = torch.zeros(rows, dtype=torch.long)
            positions[:total] = torch.cat([torch.arange(n) for n in lengths])
            cos_sin = rope.at(positions)
            hidden = F.embedding(ids, self.embedding)
            for index, layer in enumerate(self.layers):
                x = layer.input_norm(hidden)
                hidden = hidden + layer.attention.prefill(x, cos_sin, index, cache, starts)
                hidden = layer.feed_forward(hidden, routes)
            last = torch.tensor([s + n - 1 for s, n in zip(starts, lengths)])
            return self._logits(hidden, last)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, prompts: PromptKV, samples: SampleKV, step: int,
               layout: DecodeLayout, rope: Rope, routes: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One step for every row: token ids [rows] at absolute `positions` [rows], generated position `step`.
        Returns float32 logits [rows, V]. `routes`: as in prefill, [rows, top_k] per MoE layer."""
        with torch._C.DisableTorchFunction():
            cos_sin = rope.at(positions)
            hidden = F.embedding(tokens, self.embedding)
            for index, layer in enumerate(self.layers):
                x = layer.input_norm(hidden)
                hidden = hidden + layer.attention.decode(x, cos_sin, index, prompts, samples, step, layout)
                hidden = layer.feed_forward(hidden, routes)
            return self._logits(hidden, None)

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is not None:
            picked = torch.zeros(max(rows.numel(), MIN_ROWS), hidden.shape[-1], dtype=hidden.dtype)
            picked[: rows.numel()] = hidden[rows]
            hidden = picked
        logits = F.linear(self.final_norm(hidden), self.lm_head).float()
        return logits if rows is None else logits[: rows.numel()]
