"""Step-time estimate of one PPO step from FLOPs and memory bandwidth.

Compute-bound phases (training, log-prob / value forwards, prefill) take FLOPs / (GPUs x peak x MFU):
  forward  2·N·T + attention 2·L·a·d·s·T (causal QKᵀ and AV at mean context s/2; Narayanan et al. 2021)
  training 3 x forward (+1 forward with full recompute, + the attention part with selective), x ppo_epochs
N counts the matmul parameters (layers + output layer; the embedding lookup is free). Pipeline bubbles add
(p-1)/(v·m) of the time (m micro-batches per DP rank and mini-batch). Decoding is memory-bound: every step reads
the engine's weight shard and the KV cache of the running sequences once; a step takes
max(bytes / HBM bandwidth, FLOPs / (peak x MFU)). Sequences that do not fit the KV cache wait for later waves.
Every length is the configured maximum (prompt + response): an upper bound when responses stop early.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mppo.models.hf_config import HFModelArgs
from mppo.models.vocab import padded_vocab_size
from mppo.plan.memory import RoleLayout, active_layer_params


@dataclass(frozen=True)
class StepTime:
    mfu: float
    world: int  # GPUs
    peak_flops: float  # per GPU
    hbm_bytes_per_s: float
    tokens: int  # prompt + response tokens of one step (all samples)
    generation_s: float  # prefill + decode (inf when the KV cache holds no sequence)
    prefill_s: float
    decode_s: float
    decode_waves: int
    old_log_prob_s: float
    ref_s: float
    values_s: float
    update_critic_s: float
    update_actor_s: float

    @property
    def total_s(self) -> float:
        return (self.generation_s + self.old_log_prob_s + self.ref_s + self.values_s + self.update_critic_s
                + self.update_actor_s)

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens / self.total_s / self.world if math.isfinite(self.total_s) else 0.0


def matmul_params(a: HFModelArgs, role: str) -> int:
    """Parameters that take part in a matmul per token: all layers (of a MoE layer the router and top-k experts)
    plus the output layer (or value head)."""
    head = a.hidden_size if role == "critic" else padded_vocab_size(a.vocab_size, 1) * a.hidden_size
    return sum(active_layer_params(a, i) for i in range(a.num_layers)) + head


def forward_flops(a: HFModelArgs, role: str, tokens: float, seq: int) -> float:
    attention = 2 * a.num_layers * a.num_attention_heads * a.head_dim * seq * tokens
    return 2 * matmul_params(a, role) * tokens + attention


def training_flops(a: HFModelArgs, lay: RoleLayout, tokens: float, seq: int, epochs: int) -> float:
    fwd = forward_flops(a, lay.role, tokens, seq)
    extra = {"none": 0.0, "full": fwd,
             "selective": 2 * a.num_layers * a.num_attention_heads * a.head_dim * seq * tokens}[lay.recompute]
    return epochs * (3 * fwd + extra)


def bubble(lay: RoleLayout, micro_batches: float) -> float:
    """Pipeline time factor 1 + (p-1)/(v·m) (Narayanan et al. 2021)."""
    if lay.pp == 1:
        return 1.0
    return 1.0 + (lay.pp - 1) / ((lay.vpp or 1) * max(1.0, micro_batches))


@dataclass(frozen=True)
class Workload:
    """What one step computes, independent of the device."""

    samples: int  # train_batch_size x rollout.n
    prompt_len: int
    response_len: int
    world: int
    engine_tp: int
    engine_weight_bytes: float  # per engine GPU
    kv_bytes_per_token: int  # per engine GPU
    kv_capacity_tokens: float  # per engine (per GPU pool: each GPU holds its heads of the same tokens)


def generation_time(a: HFModelArgs, w: Workload, peak: float, mfu: float, hbm: float
                    ) -> tuple[float, float, int]:
    """(prefill seconds, decode seconds, waves) for the step's samples spread over world / engine_tp engines."""
    engines = max(1, w.world // w.engine_tp)
    per_engine = math.ceil(w.samples / engines)
    gpu_flops = w.engine_tp * peak * mfu
    prefill = forward_flops(a, "actor", per_engine * w.prompt_len, w.prompt_len) / gpu_flops
    seq = w.prompt_len + w.response_len
    concurrent = min(per_engine, math.floor(w.kv_capacity_tokens / seq)) if w.kv_capacity_tokens > 0 else 0
    if concurrent < 1:
        return prefill, math.inf, 0
    waves = math.ceil(per_engine / concurrent)
    mean_context = w.prompt_len + w.response_len / 2
    read = w.engine_weight_bytes + concurrent * mean_context * w.kv_bytes_per_token
    compute = forward_flops(a, "actor", concurrent, int(2 * mean_context)) / gpu_flops
    decode = waves * w.response_len * max(read / hbm, compute)
    return prefill, decode, waves
