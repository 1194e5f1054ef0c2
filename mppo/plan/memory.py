"""Per-GPU memory of one model role (actor, critic, reference) and of the rollout engine, from first principles.

Model state (what megatron-core allocates; a test compares these with a real CPU run):
  weights    params of this rank x param bytes (bf16 on GPU, fp32 on CPU)
  gradients  megatron DDP's contiguous grad buffer: fp32 (`grad_reduce_in_fp32`, the standard for bf16 training;
             fp32 params have fp32 grads anyway). It stays whole with the distributed optimizer (ZeRO-1, not -2).
  optimizer  Adam exp_avg + exp_avg_sq in fp32, plus an fp32 master copy when params are 16-bit; divided over
             DP ranks by the distributed optimizer.
A LoRA actor (mppo.models.lora) keeps its base frozen: base weights only, in their dtype (no grads, no optimizer);
its adapters, A [rank, in] and B [out, rank] per adapted HF projection, are fp32 parameters with fp32 grads and
Adam m, v (no master copy: they are fp32 already), the Adam state divided over DP by the distributed optimizer.
Column-parallel projections (q/k/v, gate/up) split B over TP and replicate A; row-parallel ones (o, down) split A
and replicate B. Their activations (rank-wide, a few MiB) are not counted.
MoE models (Qwen3-MoE): a MoE layer holds its router (replicated) and num_experts / EP experts of
3 x hidden x moe_ffn_hidden_size each (split over TP like a dense MLP); the experts' optimizer state is divided
over the expert-data-parallel ranks (DP / EP) by the distributed optimizer, the rest over DP. A MoE layer's
activations replace the MLP's: each token is dispatched to top-k experts, so with balanced routing an EP rank's
experts keep k x (their micro-batch's tokens) expert inputs (hidden wide) and k x the SwiGLU intermediates
(moe_ffn_hidden_size wide), whatever EP is; the router keeps its fp32 scores (tokens x experts).
Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2:
  TP       none  s·b·h·(10 + 24/t + 5·a·s/(h·t))  selective  s·b·h·(10 + 24/t)  full  2·s·b·h  per layer
  TP + SP  none  s·b·h·(34/t + 5·a·s/(h·t))       selective  s·b·h·34/t         full  2·s·b·h/t
(sequence parallelism splits what TP alone replicates: the norms' inputs and those of the QKV projection and fc1;
megatron's SP linears keep their input's sequence slice and all-gather it again in the backward)
Context parallelism (CP, megatron.context_parallel_size) splits each sequence into 2·CP chunks, two per rank
(load-balanced causal split), so every term above is kept for s/CP tokens per rank: the layer's activations are
its CP1 bytes / CP (the attention scores too: s/CP queries against s keys). Attention needs every earlier key, so
a rank all-gathers the K and V of the whole sequence for each layer (mppo.models.attention): without
recomputation SDPA keeps them for the backward, so every layer stores the other ranks' K/V too (2·s·(CP-1)/CP·g·d
per layer and TP rank); the backward holds one layer's full-length dK/dV until their reduce-scatter. With
selective or full recomputation they are gathered again in the backward: a transient of one layer (K/V + dK/dV).
(bytes, 16-bit activations), itemised so that it holds for this architecture: the paper's GeLU MLP (4h in, 4h out)
becomes SwiGLU (2F fc1 output + F fc2 input), its K/V become GQA's g heads, dropout masks are dropped (mppo's
models use dropout 0), and the s² attention-score term exists only with unfused (local) attention: Transformer
Engine's and SDPA's fused/flash attention keep an fp32 log-sum-exp per head and token instead. Pipeline stages hold several
micro-batches at once: megatron's 1F1B warm-up count (interleaved: the paper's factor 1 + (p-1)/(p·v)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mppo.errors import UserError
from mppo.kernels.fused_logprob import CHUNK_ELEMENTS
from mppo.models.hf_config import HFModelArgs
from mppo.models.vocab import padded_vocab_size

FP32 = 4
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq
FUSED_CHUNK_BUFFERS = 3  # live chunk-sized fp32 buffers of the fused log-prob kernel (logits, exp, grad)
FUSED_BYTES_PER_TOKEN = 4 * FP32  # the per-token statistics it saves for the backward (max, sum, lse, entropy)
NAIVE_FP32_COPIES = 3  # naive path: fp32 logits / temperature, log-softmax, softmax (entropy), besides the logits


class PlanError(UserError, ValueError):
    """The model cannot be laid out as configured (the message says what to change)."""


@dataclass(frozen=True)
class RoleLayout:
    """How one model role is sharded and run on every rank."""

    role: str  # "actor", "critic" or "ref"
    tp: int
    pp: int
    vpp: int | None  # virtual pipeline chunks per stage; None = no interleaving
    dp: int
    distributed_optimizer: bool
    recompute: str  # none | selective | full
    micro_batch: float  # samples per training forward/backward (0 for ref); fractional under token budgets
    forward_micro_batch: float  # samples per forward-only pass (log-probs / values)
    micro_batches_per_step: int  # micro-batches per mini-batch on one DP rank (pipeline warm-up bound)
    trains: bool
    offloaded: bool  # weights live in host memory between uses (ref.offload_to_cpu)
    sp: bool = False  # sequence parallelism (megatron.sequence_parallel): the TP-replicated activations split too
    ep: int = 1  # expert parallel size (MoE): each rank holds num_experts / ep experts of every MoE layer
    cp: int = 1  # context parallel size: each rank holds 1/cp of every sequence (dp counts the CP ranks out)
    lora: LoRALayout | None = None  # the actor trains LoRA adapters on its frozen base

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters: megatron's data-parallel group with context parallelism (grads are
        reduced and the distributed optimizer shards over it)."""
        return self.dp * self.cp


@dataclass(frozen=True)
class LoRALayout:
    """LoRA adapters of the actor: their rank and the HF projections adapted (mppo.config.lora.lora_projections)."""

    rank: int
    projections: tuple[str, ...]


ROW_PARALLEL_PROJECTIONS = ("o_proj", "down_proj")  # their megatron linears split the input dim over TP


@dataclass(frozen=True)
class Precision:
    param_bytes: int  # 2 (bf16) or 4 (fp32)
    grad_bytes: int  # fp32 main grads
    master_bytes: int  # fp32 master copy of 16-bit params in the optimizer, 0 for fp32 params
    act_bytes: int  # activations: the compute dtype
    flash_attention: bool  # TE or SDPA fused attention (no s² scores kept)

    @staticmethod
    def for_dtype(param_bytes: int, flash_attention: bool) -> "Precision":
        return Precision(param_bytes, FP32, 0 if param_bytes == FP32 else FP32, param_bytes, flash_attention)


# ---------------------------------------------------------------------------------------------------- parameters
def layer_params(a: HFModelArgs, tp: int, *, moe: bool = False, experts: int | None = None) -> int:
    """Parameters of one transformer layer on one TP rank (attention + SwiGLU MLP + two RMSNorms, Qwen3's q/k
    norms). `moe`: a MoE layer with `experts` of its experts (default all) and its router."""
    q, kv = a.num_attention_heads * a.head_dim, a.num_query_groups * a.head_dim
    qkv = a.hidden_size * (q + 2 * kv) + ((q + 2 * kv) if a.qkv_bias else 0)
    replicated = 2 * a.hidden_size + (2 * a.head_dim if a.qk_layernorm else 0)
    if not moe:
        sharded = qkv + q * a.hidden_size + 3 * a.hidden_size * a.ffn_hidden_size
        return math.ceil(sharded / tp) + replicated
    assert a.num_experts is not None and a.moe_ffn_hidden_size is not None
    held = a.num_experts if experts is None else experts
    sharded = qkv + q * a.hidden_size + held * 3 * a.hidden_size * a.moe_ffn_hidden_size
    return math.ceil(sharded / tp) + replicated + a.num_experts * a.hidden_size


def expert_params(a: HFModelArgs, tp: int, experts: int) -> int:
    """Parameters of `experts` routed experts of one MoE layer on one TP rank."""
    return math.ceil(experts * 3 * a.hidden_size * (a.moe_ffn_hidden_size or 0) / tp)


def active_layer_params(a: HFModelArgs, layer: int) -> int:
    """Parameters one token's matmuls use in `layer` (a MoE layer: its router and top-k experts)."""
    if layer not in a.moe_layers:
        return layer_params(a, 1)
    return layer_params(a, 1, moe=True, experts=a.moe_topk)


def stage_layers(a: HFModelArgs, lay: RoleLayout, stage: int) -> list[int]:
    """Global layer indices held by pipeline stage `stage` (its virtual chunks: chunk v x pp + stage)."""
    chunks = lay.pp * (lay.vpp or 1)
    per_chunk = a.num_layers // chunks
    return [c * per_chunk + i for c in range(stage, chunks, lay.pp) for i in range(per_chunk)]


def embedding_params(a: HFModelArgs, tp: int) -> int:
    """One vocab-parallel [padded vocab / TP, hidden] table (input embedding or output layer)."""
    return padded_vocab_size(a.vocab_size, tp) // tp * a.hidden_size


def check_layout(a: HFModelArgs, lay: RoleLayout) -> None:
    if a.num_query_groups % lay.tp:
        raise PlanError(f"{lay.role}: TP={lay.tp} does not divide the model's {a.num_query_groups} key/value heads; "
                        f"choose a tensor_model_parallel_size that divides {a.num_query_groups}")
    if a.is_moe and a.num_experts % lay.ep:
        raise PlanError(f"{lay.role}: EP={lay.ep} does not divide the model's {a.num_experts} experts; choose an "
                        f"expert_model_parallel_size that divides {a.num_experts}")
    if not a.is_moe and lay.ep > 1:
        raise PlanError(f"{lay.role}: EP={lay.ep} needs a MoE model; set expert_model_parallel_size=1")
    chunks = lay.pp * (lay.vpp or 1)
    if a.num_layers % chunks:
        raise PlanError(f"{lay.role}: {a.num_layers} layers do not split into PP x VPP = {chunks} equal chunks; "
                        f"choose pipeline sizes whose product divides {a.num_layers}")


def stage_params(a: HFModelArgs, lay: RoleLayout, stage: int) -> int:
    """Parameters held by a rank of pipeline stage `stage` (all its virtual chunks)."""
    local_experts = (a.num_experts or 0) // lay.ep
    n = sum(layer_params(a, lay.tp, moe=i in a.moe_layers, experts=local_experts) for i in stage_layers(a, lay, stage))
    if stage == 0:
        n += embedding_params(a, lay.tp)
    if stage == lay.pp - 1:
        n += a.hidden_size  # final norm
        if lay.role == "critic":
            n += a.hidden_size + 1  # value head
        elif not a.tie_word_embeddings or lay.pp > 1:  # tied at PP>1: the last stage keeps its own copy
            n += embedding_params(a, lay.tp)
    return n


def total_params(a: HFModelArgs) -> int:
    """The HF model's parameter count (unpadded vocabulary, no sharding)."""
    emb = a.vocab_size * a.hidden_size
    layers = sum(layer_params(a, 1, moe=i in a.moe_layers) for i in range(a.num_layers))
    return layers + a.hidden_size + emb * (1 if a.tie_word_embeddings else 2)


MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def lora_layer_params(a: HFModelArgs, tp: int, lora: LoRALayout, moe: bool = False) -> int:
    """Adapter parameters of one layer on one TP rank (see the module docstring for their TP split), a MoE
    layer's (`moe`) without its experts' (expert_lora_params): its MLP projections are the experts'."""
    d, h, ffn = a.head_dim, a.hidden_size, a.ffn_hidden_size
    q, kv = a.num_attention_heads * d, a.num_query_groups * d
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (ffn, h),
              "up_proj": (ffn, h), "down_proj": (h, ffn)}  # (out, in)
    n = 0
    for proj in lora.projections:
        if moe and proj in MLP_PROJECTIONS:
            continue
        out, inp = shapes[proj]
        n += lora.rank * (inp // tp + out if proj in ROW_PARALLEL_PROJECTIONS else inp + out // tp)
    return n


def expert_lora_params(a: HFModelArgs, lora: LoRALayout, local_experts: int) -> int:
    """The adapters of one MoE layer's local experts: each expert's adapted MLP projections, whole (expert-TP 1)."""
    per_expert = sum(lora.rank * (a.hidden_size + a.moe_ffn_hidden_size) for p in lora.projections
                     if p in MLP_PROJECTIONS)
    return local_experts * per_expert


def stage_lora_params(a: HFModelArgs, lay: RoleLayout, stage: int, experts_only: bool = False) -> int:
    """Adapter parameters held by a rank of pipeline stage `stage` (0 without LoRA); `experts_only`: those of the
    routed experts (their optimizer state is sharded over expert-DP = DP / EP)."""
    if lay.lora is None:
        return 0
    layers = stage_layers(a, lay, stage)
    experts = sum(expert_lora_params(a, lay.lora, (a.num_experts or 0) // lay.ep) for i in layers
                  if i in a.moe_layers)
    if experts_only:
        return experts
    return experts + sum(lora_layer_params(a, lay.tp, lay.lora, moe=i in a.moe_layers) for i in layers)


def stage_expert_params(a: HFModelArgs, lay: RoleLayout, stage: int) -> int:
    """The routed-expert parameters among stage_params (sharded over expert-DP = DP / EP, not DP)."""
    moe_layers = sum(i in a.moe_layers for i in stage_layers(a, lay, stage))
    return moe_layers * expert_params(a, lay.tp, (a.num_experts or 0) // lay.ep)


def all_to_all_bytes(a: HFModelArgs, tokens: float, ep: int, act_bytes: int) -> float:
    """Bytes one rank sends in one forward over `tokens` tokens: per MoE layer the token dispatch and the combine
    each move tokens x top-k hidden vectors, of which (EP - 1) / EP go to other ranks (uniform routing). A
    backward moves as much again."""
    if not a.is_moe or ep == 1:
        return 0.0
    return len(a.moe_layers) * 2 * tokens * a.moe_topk * a.hidden_size * act_bytes * (ep - 1) / ep


@dataclass(frozen=True)
class ModelState:
    params: int  # the model's (a LoRA actor: its frozen base's)
    weights: int  # bytes on the GPU (0 when offloaded); a LoRA actor: base + fp32 adapters
    host_weights: int  # bytes kept in host memory (offloaded reference)
    grads: int
    optimizer: int
    optimizer_unsharded: int  # what the optimizer would take without the distributed optimizer
    adapter_params: int = 0  # LoRA: the trained adapter parameters (fp32), besides the frozen `params`

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer


def model_state(a: HFModelArgs, lay: RoleLayout, prec: Precision, stage: int) -> ModelState:
    params = stage_params(a, lay, stage)
    weights = params * prec.param_bytes
    if not lay.trains:
        return ModelState(params, 0 if lay.offloaded else weights, weights if lay.offloaded else 0, 0, 0, 0)
    if lay.lora is not None:  # frozen base: weights only; fp32 adapters with fp32 grads and Adam m, v
        adapters = stage_lora_params(a, lay, stage)
        experts = stage_lora_params(a, lay, stage, experts_only=True)
        opt = adapters * ADAM_MOMENTS * FP32
        sharded = (math.ceil((adapters - experts) * ADAM_MOMENTS * FP32 / lay.replicas)
                   + math.ceil(experts * ADAM_MOMENTS * FP32 / (lay.replicas // lay.ep))) \
            if lay.distributed_optimizer else opt
        return ModelState(params, weights + adapters * FP32, 0, adapters * FP32, sharded, opt, adapters)
    per_param = prec.master_bytes + ADAM_MOMENTS * FP32
    opt = params * per_param
    experts = stage_expert_params(a, lay, stage)
    sharded = (math.ceil((params - experts) * per_param / lay.replicas)
               + math.ceil(experts * per_param / (lay.replicas // lay.ep))) if lay.distributed_optimizer else opt
    return ModelState(params, weights, 0, params * prec.grad_bytes, sharded, opt)


# --------------------------------------------------------------------------------------------------- activations
def layer_activation_bytes(a: HFModelArgs, tp: int, seq: int, batch: float, prec: Precision,
                           recompute: str, *, moe: bool = False, sp: bool = False, cp: int = 1) -> float:
    """Bytes one layer (`moe`: a MoE layer; `sp`: under sequence parallelism; `cp`: on one of `cp` context-parallel
    ranks) keeps for the backward of one micro-batch [batch x seq] (see the module docstring)."""
    sb, e, h = seq * batch / cp, prec.act_bytes, a.hidden_size  # the tokens of this rank's sequence chunks
    split = tp if sp else 1  # what TP alone replicates, SP splits along the sequence
    if recompute == "full":
        return sb * h * e / split  # only the layer input; the rest is recomputed
    if moe:  # fc1's input: the k dispatched copies of each token, gathered over TP for the TP-split experts (so
        # not split by SP), and the router's fp32 scores; fc1 output and fc2 input: k x the expert width
        fc1_input = a.moe_topk * sb * h * e + sb * (a.num_experts or 0) * FP32 / split
        mlp = 3 * a.moe_topk * sb * (a.moe_ffn_hidden_size or 0)
    else:
        fc1_input, mlp = sb * h * e / split, 3 * sb * a.ffn_hidden_size
    # replicated over TP (split over it by SP): inputs of the two norms, of the QKV projection and of fc1 (MoE: the
    # dispatched tokens and the router scores)
    replicated = 3 * sb * h * e / split + fc1_input
    # split over TP: Q, K, V; the attention output (out-projection input); SwiGLU's fc1 output and fc2 input
    qkv = sb * a.head_dim * (a.num_attention_heads + 2 * a.num_query_groups)
    sharded = (qkv + sb * a.num_attention_heads * a.head_dim + mlp) * e / tp
    if prec.flash_attention:
        scores = sb * a.num_attention_heads * FP32 / tp  # log-sum-exp per head and token
    else:
        scores = batch * a.num_attention_heads * (seq / cp) * seq * e / tp  # softmax output: local queries x keys
    # CP: the other ranks' K/V, all-gathered for the attention and kept by it (the local ones are in `qkv`)
    gathered_kv = 2 * batch * seq * (cp - 1) / cp * a.num_query_groups * a.head_dim * e / tp
    if recompute == "selective":  # core attention redone: neither its scores nor the gathered K/V are kept
        return replicated + sharded
    return replicated + sharded + scores + gathered_kv


def cp_kv_gather_bytes(a: HFModelArgs, tp: int, seq: int, batch: float, prec: Precision, cp: int,
                       backward: bool) -> float:
    """The whole sequence's K and V of one layer on one TP rank, all-gathered over the CP ranks for its attention
    (0 without CP); the backward also holds their full-length gradients until the reduce-scatter."""
    if cp == 1:
        return 0.0
    kv = 2 * seq * batch * a.num_query_groups * a.head_dim * prec.act_bytes / tp
    return kv * (2 if backward else 1)


def layers_in_flight(a: HFModelArgs, lay: RoleLayout, stage: int) -> float:
    """Layer-activations a stage holds at the peak of megatron's schedule, in units of (layer x micro-batch)."""
    m = max(1, lay.micro_batches_per_step)
    if lay.pp == 1:
        return a.num_layers  # one micro-batch at a time
    if not lay.vpp:
        return min(lay.pp - stage, m) * a.num_layers / lay.pp
    warmup = (lay.pp - stage - 1) * 2 + (lay.vpp - 1) * lay.pp  # megatron's interleaved warm-up micro-batches
    return min(warmup + 1, m * lay.vpp) * a.num_layers / (lay.pp * lay.vpp)


def training_activations(a: HFModelArgs, lay: RoleLayout, prec: Precision, seq: int, stage: int
                         ) -> tuple[float, float]:
    """(bytes of one micro-batch's activations on this stage, bytes at the schedule's peak)."""
    layers = stage_layers(a, lay, stage)
    # a layer's mean over the stage's layers (dense and MoE layers differ)
    stored = sum(layer_activation_bytes(a, lay.tp, seq, lay.micro_batch, prec, lay.recompute,
                                        moe=i in a.moe_layers, sp=lay.sp, cp=lay.cp) for i in layers) / len(layers)
    per_micro = stored * a.num_layers / lay.pp
    peak = stored * layers_in_flight(a, lay, stage)
    if lay.recompute == "full":  # the backward recomputes one layer with everything kept
        peak += max(layer_activation_bytes(a, lay.tp, seq, lay.micro_batch, prec, "none", moe=i in a.moe_layers,
                                           sp=lay.sp, cp=lay.cp) for i in layers)
    # one layer's attention backward at a time (CP only): the full-length dK/dV, and under selective recomputation
    # the K/V gathered again (otherwise they are in the stored or recomputed layer, counted above)
    peak += cp_kv_gather_bytes(a, lay.tp, seq, lay.micro_batch, prec, lay.cp, backward=True) / (
        1 if lay.recompute == "selective" else 2)
    return per_micro, peak


def forward_only_bytes(a: HFModelArgs, tp: int, seq: int, batch: float, prec: Precision, sp: bool = False,
                       cp: int = 1) -> float:
    """Transient working set of a no-grad forward: about one layer's intermediate tensors (the larger kind), and
    under CP that layer's all-gathered K/V."""
    return (max(layer_activation_bytes(a, tp, seq, batch, prec, "none", moe=moe, sp=sp, cp=cp)
                for moe in {i in a.moe_layers for i in range(a.num_layers)})
            + cp_kv_gather_bytes(a, tp, seq, batch, prec, cp, backward=False))


# -------------------------------------------------------------------------------------------- log-prob working set
def logprob_bytes(a: HFModelArgs, tp: int, tokens: float, prec: Precision, fused: bool) -> float:
    """Memory of turning [tokens, hidden] into log-probs + entropy on one TP rank (`tokens`: this rank's; under CP
    a rank scores only its own chunks of each sequence).

    naive: the output layer's logits [tokens x V/TP] plus NAIVE_FP32_COPIES fp32 tensors of that size.
    fused: at most FUSED_CHUNK_BUFFERS fp32 chunks of CHUNK_ELEMENTS logits, plus per-token statistics.
    """
    v_local = padded_vocab_size(a.vocab_size, tp) // tp
    naive = tokens * v_local * (prec.act_bytes + NAIVE_FP32_COPIES * FP32)
    if not fused:
        return naive
    chunk = min(tokens * v_local, CHUNK_ELEMENTS)
    return FUSED_CHUNK_BUFFERS * chunk * FP32 + tokens * FUSED_BYTES_PER_TOKEN


# ------------------------------------------------------------------------------------------------- rollout engine
def kv_bytes_per_token(a: HFModelArgs, engine_tp: int, kv_bytes: int) -> int:
    """K and V of one token in every layer on one engine GPU (KV heads replicate when TP exceeds them)."""
    heads = math.ceil(a.num_query_groups / engine_tp)
    return 2 * a.num_layers * heads * a.head_dim * kv_bytes


def engine_weight_bytes(a: HFModelArgs, engine_tp: int, param_bytes: int) -> float:
    return total_params(a) * param_bytes / engine_tp
