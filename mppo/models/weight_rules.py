"""How megatron parameters map to HF tensors: naming, TP sharding and fusing, in both directions.

Layout differences handled here (megatron-core names, HF Qwen2/Llama/Qwen3/Qwen3-MoE names):
- linear_qkv = per key/value group g: [q heads of g; k_g; v_g]; TP splits whole groups.
- linear_fc1 = [gate; up], and TP splits gate and up separately: rank r holds [gate_r; up_r].
- linear_proj / linear_fc2 are row-parallel (TP splits the input dimension); norms are replicated.
- embedding / output layer hold the padded vocabulary (mppo.models.vocab), split by rows over TP.
- Transformer Engine fuses the input norms into linear_qkv / linear_fc1 (`layer_norm_weight`); both namings map.
- critic: output_layer.{weight,bias} <-> HF `score.{weight,bias}` (AutoModelForTokenClassification, 1 label).
- Qwen3: q_layernorm / k_layernorm (over head_dim, replicated) <-> self_attn.q_norm / k_norm.
- MoE layers: the router (replicated, also over EP) <-> mlp.gate; local expert i of a rank holds global expert
  `mlp.local_expert_indices[i]` (EP rank x experts per rank + i), its linear_fc1 / linear_fc2 sharded like a dense
  MLP's but over the expert-TP group, <-> mlp.experts.{e}.gate_proj / up_proj / down_proj. `WeightRule.expert`
  marks them: they live on one EP rank only, every other parameter on every EP rank.

`read_shard` cuts one TP rank's shard out of the HF tensors (loading); `place_shard` writes a shard back into its
places in the full HF tensors (exporting). They are each other's inverse, and the only place the layout lives.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.builders import ValueHead
from mppo.models.hf_config import HFModelArgs


class SliceSource(Protocol):
    """Where HF tensors are read from (mppo.models.weights.SafetensorsCheckpoint): `slice(name)[a:b]` reads rows."""

    def slice(self, name: str): ...


# megatron layer-local suffix -> (how it is sharded/fused, HF suffixes under model.layers.{L}.)
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
}
# one routed expert's weights: megatron suffix after mlp.experts.local_experts.{i}. -> (kind, HF suffixes after
# mlp.experts.{global expert}.)
_EXPERT_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "linear_fc1.weight": ("fc1", ("gate_proj.weight", "up_proj.weight")),
    "linear_fc2.weight": ("row", ("down_proj.weight",)),
}
_LAYER_ORDER = {suffix: i for i, suffix in enumerate([*_LAYER_RULES, *_EXPERT_RULES])}
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")


@dataclass(frozen=True)
class WeightRule:
    """How one megatron parameter relates to HF tensors. `order` sorts parameters into HF order."""

    kind: str  # replicated | vocab | row | qkv | fc1
    hf_names: tuple[str, ...]
    order: tuple[int, int, int, int]  # (part, layer, weight in the layer, global expert or -1)
    expert: bool = False  # a routed expert's weight: sharded over expert-TP, held by one EP rank


def weight_rule(model: nn.Module, name: str) -> WeightRule | None:
    """The rule for parameter `name` of a GPTModel chunk; None for a tied output layer (a copy of the embedding).

    Layer indices in `name` are chunk-local; the HF name uses the global layer (megatron's 1-based layer_number).
    """
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if name == "embedding.word_embeddings.weight":
        return WeightRule("vocab", ("model.embed_tokens.weight",), (0, 0, 0, -1))
    if name == "decoder.final_layernorm.weight":
        return WeightRule("replicated", ("model.norm.weight",), (2, 0, 0, -1))
    if isinstance(getattr(model, "output_layer", None), ValueHead):
        if name in ("output_layer.weight", "output_layer.bias"):
            return WeightRule("replicated", ("score." + name.split(".")[-1],),
                              (3, 0, int(name.endswith("bias")), -1))
    if name == "output_layer.weight":
        return None if tied else WeightRule("vocab", ("lm_head.weight",), (3, 0, 0, -1))
    match = _LAYER_RE.fullmatch(name)
    if match:
        module = model.decoder.layers[int(match.group(1))]
        layer, suffix = module.layer_number - 1, match.group(2)
        if suffix in _LAYER_RULES:
            kind, suffixes = _LAYER_RULES[suffix]
            return WeightRule(kind, tuple(f"model.layers.{layer}.{s}" for s in suffixes),
                              (1, layer, _LAYER_ORDER[suffix], -1))
        expert = _EXPERT_RE.fullmatch(suffix)
        if expert and expert.group(2) in _EXPERT_RULES:
            index = module.mlp.local_expert_indices[int(expert.group(1))]
            kind, suffixes = _EXPERT_RULES[expert.group(2)]
            return WeightRule(kind, tuple(f"model.layers.{layer}.mlp.experts.{index}.{s}" for s in suffixes),
                              (1, layer, _LAYER_ORDER[expert.group(2)], index), expert=True)
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")


def tp_layout(expert: bool = False) -> tuple[int, int, dist.ProcessGroup]:
    """(TP rank, TP size, TP group) of this rank, from megatron's parallel state; with `expert`, those of the
    expert-tensor-parallel group that shards routed experts (mppo builds it equal to TP)."""
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(), \
            ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_group()


def read_shard(ckpt: SliceSource, rule: WeightRule, args: HFModelArgs, param: torch.Tensor,
               tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's shard of `param`, read from the HF tensors."""
    if rule.kind == "replicated":
        return ckpt.slice(rule.hf_names[0])[:]
    if rule.kind == "vocab":
        rows = param.shape[0]
        start = tp_rank * rows
        real = max(0, min(rows, args.vocab_size - start))
        out = torch.zeros(param.shape, dtype=param.dtype)
        if real:
            out[:real] = ckpt.slice(rule.hf_names[0])[start:start + real]
        return out
    if rule.kind == "row":
        cols = param.shape[1]
        return ckpt.slice(rule.hf_names[0])[:, tp_rank * cols:(tp_rank + 1) * cols]
    if rule.kind == "fc1":
        rows = param.shape[0] // 2
        gate, up = (ckpt.slice(n)[tp_rank * rows:(tp_rank + 1) * rows] for n in rule.hf_names)
        return torch.cat([gate, up])
    if rule.kind == "qkv":
        d, qpg = args.head_dim, args.heads_per_group
        groups = args.num_query_groups // tp
        g0 = tp_rank * groups
        q = ckpt.slice(rule.hf_names[0])[g0 * qpg * d:(g0 + groups) * qpg * d]
        k, v = (ckpt.slice(n)[g0 * d:(g0 + groups) * d] for n in rule.hf_names[1:])
        rest = tuple(q.shape[1:])
        fused = torch.cat([q.reshape(groups, qpg * d, *rest), k.reshape(groups, d, *rest),
                           v.reshape(groups, d, *rest)], dim=1)
        return fused.reshape(-1, *rest)
    raise ValueError(f"unknown weight kind {rule.kind!r}")


def full_shapes(rule: WeightRule, local: torch.Size, args: HFModelArgs, tp: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of the full HF tensors made from a parameter whose TP shard has shape `local`."""
    rest = tuple(local[1:])
    if rule.kind == "replicated":
        return (tuple(local),)
    if rule.kind == "vocab":
        return ((args.vocab_size, *rest),)
    if rule.kind == "row":
        return ((local[0], local[1] * tp),)
    if rule.kind == "fc1":
        return ((local[0] // 2 * tp, *rest),) * 2
    d, groups = args.head_dim, args.num_query_groups
    return (args.num_attention_heads * d, *rest), (groups * d, *rest), (groups * d, *rest)


def place_shard(rule: WeightRule, shard: torch.Tensor, full: Sequence[torch.Tensor], args: HFModelArgs,
                tp_rank: int, tp: int) -> None:
    """Copy TP rank `tp_rank`'s shard of one megatron parameter into its places in the full HF tensors `full`
    (casting to their dtype): the inverse of `read_shard`. Replicated parameters are taken from TP rank 0 only,
    the vocabulary padding rows are dropped."""
    if rule.kind == "replicated":
        if tp_rank == 0:
            full[0].copy_(shard)
    elif rule.kind == "vocab":
        rows = shard.shape[0]
        start = tp_rank * rows
        real = max(0, min(rows, args.vocab_size - start))
        if real:
            full[0][start:start + real].copy_(shard[:real])
    elif rule.kind == "row":
        cols = shard.shape[1]
        full[0][:, tp_rank * cols:(tp_rank + 1) * cols].copy_(shard)
    elif rule.kind == "fc1":
        rows = shard.shape[0] // 2
        full[0][tp_rank * rows:(tp_rank + 1) * rows].copy_(shard[:rows])
        full[1][tp_rank * rows:(tp_rank + 1) * rows].copy_(shard[rows:])
    elif rule.kind == "qkv":
        d, qpg = args.head_dim, args.heads_per_group
        groups = args.num_query_groups // tp
        g0, rest = tp_rank * groups, tuple(shard.shape[1:])
        grouped = shard.reshape(groups, (qpg + 2) * d, *rest)
        q, k, v = grouped.split([qpg * d, d, d], dim=1)
        full[0].view(args.num_query_groups, qpg * d, *rest)[g0:g0 + groups].copy_(q)
        full[1].view(args.num_query_groups, d, *rest)[g0:g0 + groups].copy_(k)
        full[2].view(args.num_query_groups, d, *rest)[g0:g0 + groups].copy_(v)
    else:
        raise ValueError(f"unknown weight kind {rule.kind!r}")
