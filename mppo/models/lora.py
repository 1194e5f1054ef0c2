"""LoRA adapters on megatron-core's tensor-parallel linears, laid out so that they ARE HF PEFT's adapters.

`apply_lora` freezes every base parameter and attaches, to each targeted linear of this rank's layers (its PP
stage), one adapter per HF projection fused into it: linear_qkv gets q_proj / k_proj / v_proj adapters, linear_fc1
gate_proj / up_proj ones, linear_proj o_proj, linear_fc2 down_proj. Each adapter is PEFT's: y += B(A(dropout(x)))
* alpha / rank (a dropout mask of its own, as in PEFT: LinearAdapters.dropped_inputs), A [rank, in] and B [out,
rank] in fp32 (whatever the base dtype), A drawn like PEFT's default (kaiming-uniform, a=sqrt(5)) as a full tensor
from a generator seeded by (the actor's seed, the adapter's HF name), so every TP/PP layout starts from the same
tensors and another seed from others, and B = 0, so the model starts as the base exactly.

TP sharding follows the base (mppo.models.weight_rules):
- column-parallel (linear_qkv, linear_fc1; the output dim is split): A replicated, B split by rows like the base
  rows of its projection (q/k/v by key/value groups, gate/up each by rows). h = A x is replicated; its gradient,
  partial per rank (each holds a slice of B), is all-reduced over TP (copy_to_tensor_model_parallel_region).
  With sequence parallelism x is [s/tp, b, h]: h is all-gathered along the sequence (its backward
  reduce-scatters), and A's gradient, partial over the sequence, is all-reduced by megatron's finalize_model_grads
  (`param.sequence_parallel`, as for the norms).
- row-parallel (linear_proj, linear_fc2; the input dim is split): A split by columns like the base, B replicated.
  h = A x is a partial sum, all-reduced (reduce_from_tensor_model_parallel_region), or reduce-scattered along
  the sequence with sequence parallelism (then B's gradient is the sequence-partial one).
The fused linears' delta is re-interleaved into the base's fused output layout ([q; k; v] per key/value group,
[gate; up]), so the adapters are per projection exactly as PEFT's on the HF model.

The adapters run as a forward hook on the linear (its output + delta), so the base module, its parameter names and
its checkpoint keys stay megatron's; `linear.lora` holds the parameters (`...linear_qkv.lora.lora_A.q_proj`).
`adapters_disabled` turns them off (the reference policy = the base); `export_parameters` gives the exporter
base + scale * B @ A merged per TP shard (no extra communication; lazily, one weight at a time);
mppo.models.lora_io writes and reads PEFT adapter directories.

Transformer Engine: TE's column-parallel linears fuse the input norm (`layer_norm_weight`); the hook then applies
that norm to the adapters' input (RMSNorm / LayerNorm as the config says). That path has not been run: this
machine has no CUDA and no Transformer Engine.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mppo.config.lora import MEGATRON_LINEARS
from mppo.models.builders import unwrap_model
from mppo.models.hf_config import HFModelArgs

# megatron module path inside a layer -> (its megatron linear name, HF module prefix inside the layer, parallel kind)
LAYER_LINEARS: dict[str, tuple[str, str, str]] = {
    "self_attention.linear_qkv": ("linear_qkv", "self_attn", "column"),
    "self_attention.linear_proj": ("linear_proj", "self_attn", "row"),
    "mlp.linear_fc1": ("linear_fc1", "mlp", "column"),
    "mlp.linear_fc2": ("linear_fc2", "mlp", "row"),
}


@dataclass(frozen=True)
class LoRASpec:
    """What adapters to build: rank, alpha (scale = alpha / rank), dropout and the HF projections adapted."""

    rank: int
    alpha: float
    dropout: float
    projections: tuple[str, ...]
    seed: int = 0  # A's initialisation: one generator per adapter, seeded by (seed, HF name); the actor's seed

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def projection_shapes(args: HFModelArgs, expert: bool = False) -> dict[str, tuple[int, int]]:
    """Full (out, in) of each HF projection of one decoder layer (`expert`: of one MoE expert's MLP)."""
    h, d = args.hidden_size, args.head_dim
    ffn = args.moe_ffn_hidden_size if expert else args.ffn_hidden_size
    q, kv = args.num_attention_heads * d, args.num_query_groups * d
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}


def initial_a(hf_name: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """PEFT's default A (kaiming_uniform_ with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), the same full tensor at every
    layout: drawn from a generator seeded by (`seed`, the adapter's HF module name)."""
    digest = hashlib.sha256(f"{seed}:{hf_name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class LinearAdapters(nn.Module):
    """The adapters of one megatron linear, one per HF projection fused into it (this TP rank's shards)."""

    def __init__(self, *, linear_name: str, kind: str, hf_prefix: str, projections: Sequence[str],
                 args: HFModelArgs, spec: LoRASpec, tp_rank: int, tp: int, sequence_parallel: bool,
                 device: torch.device, expert: bool = False, allreduce: bool = True):
        """`expert`: a MoE expert's linear (expert-TP 1: whole, on the tokens routed to it, so no TP
        communication); `allreduce`: its base weight's megatron flag, False for experts under EP (DDP then
        reduces their gradients over the expert-data-parallel group only)."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.expert = expert
        self.kind, self.linear_name, self.hf_prefix = kind, linear_name, hf_prefix
        self.fused = MEGATRON_LINEARS[linear_name]  # every projection of the linear, in its fused order
        self.projections = tuple(p for p in self.fused if p in projections)
        self.scale, self.rank = spec.scale, spec.rank
        self.sequence_parallel = sequence_parallel
        self.split_input = tp > 1 and (kind == "row" or sequence_parallel)  # each TP rank holds a part of x
        self.enabled = True
        self.groups, self.heads_per_group, self.head_dim = args.num_query_groups // tp, args.heads_per_group, \
            args.head_dim
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        shapes = projection_shapes(args, expert=expert)
        self.out_local = {p: shapes[p][0] // tp if kind == "column" else shapes[p][0] for p in self.fused}
        for proj in self.projections:
            out, inp = shapes[proj]
            a_full = initial_a(f"{hf_prefix}.{proj}", (spec.rank, inp), spec.seed)
            if kind == "column":
                a, b = a_full, torch.zeros(out // tp, spec.rank)
            else:
                cols = inp // tp
                a, b = a_full[:, tp_rank * cols:(tp_rank + 1) * cols].clone(), torch.zeros(out, spec.rank)
            self.lora_A[proj] = nn.Parameter(a.to(device))
            self.lora_B[proj] = nn.Parameter(b.to(device))
            if not allreduce:
                self.lora_A[proj].allreduce = self.lora_B[proj].allreduce = False
            sharded, replicated = (self.lora_B[proj], self.lora_A[proj]) if kind == "column" else \
                (self.lora_A[proj], self.lora_B[proj])
            set_tensor_model_parallel_attributes(sharded, True, 0 if kind == "column" else 1, 1)
            # the replicated one's gradient is partial over the sequence under SP: summed over TP by megatron
            replicated.sequence_parallel = sequence_parallel

    def tp_axes(self) -> dict[str, int]:
        """Checkpoint key (inside the linear) -> the TP-split axis, for the sharded adapter tensors."""
        which = "lora_B" if self.kind == "column" else "lora_A"
        return {f"lora.{which}.{p}": 0 if self.kind == "column" else 1 for p in self.projections}

    def fuse(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-projection outputs [..., out_p] -> the linear's fused local output layout [..., out]; projections
        without an adapter contribute zeros."""
        some = next(iter(parts.values()))
        lead = some.shape[:-1]
        full = [parts[p] if p in parts else some.new_zeros(*lead, self.out_local[p]) for p in self.fused]
        if self.linear_name != "linear_qkv":
            return torch.cat(full, dim=-1)
        q, k, v = full  # per key/value group: [q heads of the group; k; v], as weight_rules' "qkv" layout
        g, d = self.groups, self.head_dim
        return torch.cat([q.reshape(*lead, g, self.heads_per_group * d), k.reshape(*lead, g, d),
                          v.reshape(*lead, g, d)], dim=-1).reshape(*lead, -1)

    def dropped_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The input of each adapter: PEFT's dropout, a mask of its own per projection (also inside the fused
        linears), after the cast to fp32 as PEFT casts first. In training mode only: the log-prob and value passes
        run in eval mode (mppo.workers.pipeline). A TP-replicated input draws from the default generator, the same
        on every TP rank (so the replicated h = A x stays equal); a TP-split one (row-parallel, or sequence
        parallel) from megatron's model-parallel RNG, different per TP rank as a mask of the full input is."""
        from megatron.core import tensor_parallel as tpl

        x = x.to(torch.float32)
        if not (self.training and isinstance(self.dropout, nn.Dropout)):
            return [x] * len(self.projections)
        with tpl.get_cuda_rng_tracker().fork() if self.split_input else contextlib.nullcontext():
            return [self.dropout(x) for _ in self.projections]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        h = torch.cat([nn.functional.linear(xp, self.lora_A[p]) for p, xp in zip(self.projections,
                                                                                  self.dropped_inputs(x))], dim=-1)
        if self.expert:
            pass  # a whole expert on its own tokens: nothing to gather or reduce
        elif self.kind == "column":
            h = tpl.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True) \
                if self.sequence_parallel else tpl.copy_to_tensor_model_parallel_region(h)
        else:
            h = tpl.reduce_scatter_to_sequence_parallel_region(h) if self.sequence_parallel else \
                tpl.reduce_from_tensor_model_parallel_region(h)
        hs = h.split(self.rank, dim=-1)
        return self.fuse({p: nn.functional.linear(hp, self.lora_B[p]) * self.scale
                          for p, hp in zip(self.projections, hs)})

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A per projection, fused like the base weight shard: [out_local, in_local] fp32."""
        parts = {p: (self.lora_B[p].detach().float() @ self.lora_A[p].detach().float()).t() * self.scale
                 for p in self.projections}
        return self.fuse(parts).t()


def _adapter_input(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What the base weight multiplies: `x`, or for Transformer Engine's norm-fused linears the normed `x`
    (untested here: no CUDA / Transformer Engine on this machine)."""
    weight = getattr(linear, "layer_norm_weight", None)
    if weight is None:
        return x
    config = linear.config
    w = weight.float() + (1.0 if getattr(config, "layernorm_zero_centered_gamma", False) else 0.0)
    xf = x.float()
    if config.normalization == "RMSNorm":
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon) * w
    bias = getattr(linear, "layer_norm_bias", None)
    return nn.functional.layer_norm(xf, xf.shape[-1:], w, None if bias is None else bias.float(),
                                    config.layernorm_epsilon)


def _lora_hook(linear: nn.Module, inputs: tuple, output):
    adapters: LinearAdapters = linear.lora
    if not adapters.enabled:
        return output
    out, bias = output
    return out + adapters(_adapter_input(linear, inputs[0])).to(out.dtype), bias


def _sharded_state_dict(linear: nn.Module, prefix: str = "", sharded_offsets=(), metadata=None):
    """The linear's own sharded state dict, with its adapters split over TP where they are (megatron's would take
    every extra tensor as replicated)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state = type(linear).sharded_state_dict(linear, prefix, sharded_offsets, metadata)
    adapters = {f"lora.{k}": v for k, v in linear.lora.state_dict(keep_vars=True).items()}
    extra = {} if metadata is None or "dp_cp_group" not in metadata else {"dp_cp_group": metadata["dp_cp_group"]}
    state.update(make_sharded_tensors_for_checkpoint(adapters, prefix, linear.lora.tp_axes(), sharded_offsets,
                                                     tp_group=getattr(linear, "tp_group", None), **extra))
    return state


def _check_linear(linear: nn.Module, path: str) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    known = (ColumnParallelLinear, RowParallelLinear)
    try:
        from megatron.core.extensions.transformer_engine import TELinear

        known = (*known, TELinear)
    except ImportError:  # no Transformer Engine: megatron's own linears only
        pass
    if not isinstance(linear, known):
        raise TypeError(f"LoRA adapts megatron-core's tensor-parallel linears; {path} is a {type(linear).__name__}")


def apply_lora(model_chunks: Sequence[nn.Module], args: HFModelArgs, spec: LoRASpec,
               base_dir: str | None = None) -> None:
    """Freeze every parameter of these chunks and attach the adapters of `spec` to this rank's layers (nothing
    collective: each rank builds its own shards). Call after the base weights are loaded, before DDP wrapping.
    `base_dir`: the base model's HF directory, recorded (`lora_info`) for checkpoints."""
    from megatron.core import parallel_state as ps

    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        model.requires_grad_(False)
        model.lora_info = LoRAInfo(spec, base_dir)
        device = next(model.parameters()).device
        for layer in model.decoder.layers:
            for path, (linear_name, hf_module, kind) in LAYER_LINEARS.items():
                wanted = [p for p in MEGATRON_LINEARS[linear_name] if p in spec.projections]
                if not wanted:
                    continue
                hf_layer = f"model.layers.{layer.layer_number - 1}"
                if hf_module == "mlp" and hasattr(layer.mlp, "experts"):  # a MoE layer: every local expert's
                    for hf_expert, linear in _expert_linears(layer.mlp, linear_name):
                        _attach(linear, f"{path} of {hf_expert}", LinearAdapters(
                            linear_name=linear_name, kind=kind, hf_prefix=f"{hf_layer}.{hf_expert}",
                            projections=wanted, args=args, spec=spec, tp_rank=0, tp=1, sequence_parallel=False,
                            device=device, expert=True, allreduce=getattr(linear.weight, "allreduce", True)))
                    continue
                _attach(layer.get_submodule(path), path, LinearAdapters(
                    linear_name=linear_name, kind=kind, hf_prefix=f"{hf_layer}.{hf_module}", projections=wanted,
                    args=args, spec=spec, tp_rank=tp_rank, tp=tp,
                    sequence_parallel=bool(model.config.sequence_parallel), device=device))


def _attach(linear: nn.Module, path: str, adapters: LinearAdapters) -> None:
    _check_linear(linear, path)
    linear.lora = adapters
    linear.register_forward_hook(_lora_hook)
    linear.sharded_state_dict = _sharded_state_dict.__get__(linear)


def _expert_linears(moe_layer: nn.Module, linear_name: str) -> Iterator[tuple[str, nn.Module]]:
    """(HF module of the expert, e.g. `mlp.experts.3`, its megatron linear) for each expert on this rank.
    Megatron's SequentialMLP holds one MLP per local expert (mppo builds MoE layers so: HF's per-expert
    weights); its experts are whole on each rank only at expert-TP 1."""
    from megatron.core import parallel_state as ps

    experts = moe_layer.experts
    if not hasattr(experts, "local_experts"):
        raise TypeError(f"LoRA on MoE experts needs megatron's SequentialMLP; this layer has {type(experts).__name__}")
    if ps.get_expert_tensor_parallel_world_size() > 1:
        raise ValueError("LoRA on MoE experts is built for whole experts (expert-TP 1): set "
                         "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1, or leave gate_proj, "
                         "up_proj and down_proj out of lora.target_modules")
    for index, expert in zip(moe_layer.local_expert_indices, experts.local_experts):  # global expert indices
        yield f"mlp.experts.{index}", expert.get_submodule(linear_name)


@dataclass(frozen=True)
class LoRAInfo:
    """What a LoRA model was built with: its spec and its base model's directory."""

    spec: LoRASpec
    base_dir: str | None


def lora_info(model_chunks: Sequence[nn.Module]) -> LoRAInfo | None:
    """The LoRAInfo of chunks built by apply_lora; None for a full-weight model."""
    return getattr(unwrap_model(model_chunks[0]), "lora_info", None)


def iter_adapters(model_chunks: Sequence[nn.Module]) -> Iterator[LinearAdapters]:
    for chunk in model_chunks:
        for module in unwrap_model(chunk).modules():
            if isinstance(module, LinearAdapters):
                yield module


def has_adapters(model_chunks: Sequence[nn.Module]) -> bool:
    return next(iter_adapters(model_chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(model_chunks: Sequence[nn.Module]) -> Iterator[None]:
    """The base model for the block: every adapter off (the reference policy of a LoRA actor)."""
    adapters = list(iter_adapters(model_chunks))
    before = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(adapters, before):
            a.enabled = was


def is_adapter_parameter(name: str) -> bool:
    return ".lora.lora_" in name


class MergedWeight:
    """A base weight shard with its adapters merged, computed when the exporter reads it (`detach()`), so an export
    holds one merged weight at a time. Has what the exporter reads of a parameter: shape, dtype, device."""

    def __init__(self, weight: torch.Tensor, adapters: LinearAdapters):
        self.weight, self.adapters = weight, adapters
        self.shape, self.dtype, self.device = weight.shape, weight.dtype, weight.device

    def detach(self) -> torch.Tensor:
        with torch.no_grad():
            return (self.weight.detach().float() + self.adapters.delta_weight()).to(self.dtype)


def export_parameters(model: nn.Module) -> Iterator[tuple[str, torch.Tensor | MergedWeight]]:
    """A GPTModel chunk's `named_parameters()` as the HF exporter needs them: adapter parameters left out, each
    adapted weight merged (base + scale * B @ A, this TP shard's), unless its adapters are off (adapters_disabled:
    the base, as for adapter-only sync). The model itself is unchanged."""
    for name, param in model.named_parameters():
        if is_adapter_parameter(name):
            continue
        owner, _, leaf = name.rpartition(".")
        adapters = getattr(model.get_submodule(owner), "lora", None) if leaf == "weight" else None
        yield name, param if adapters is None or not adapters.enabled else MergedWeight(param, adapters)


def lora_spec(lora_cfg, seed: int) -> LoRASpec:
    """The LoRASpec of an `actor_rollout_ref.model.lora` section (mppo.config.schema.LoRAConfig); `seed`: the actor's
    (`actor_rollout_ref.actor.megatron.seed`, trainer.seed unless set), which draws the initial A."""
    from mppo.config.lora import lora_projections

    return LoRASpec(rank=int(lora_cfg.rank), alpha=float(lora_cfg.alpha), dropout=float(lora_cfg.dropout),
                    projections=lora_projections(lora_cfg.target_modules, lora_cfg.exclude_modules), seed=seed)
