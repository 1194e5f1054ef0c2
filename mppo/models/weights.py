"""HF <-> Megatron weights. One exporter feeds both the rollout weight sync and `mppo convert`.

Layout differences handled here (megatron-core names, HF Qwen2/Llama names):
- linear_qkv = per key/value group g: [q heads of g; k_g; v_g]; TP splits whole groups.
- linear_fc1 = [gate; up], and TP splits gate and up separately: rank r holds [gate_r; up_r].
- linear_proj / linear_fc2 are row-parallel (TP splits the input dimension); norms are replicated.
- embedding / output layer hold the padded vocabulary (mppo.models.vocab), split by rows over TP.
- Transformer Engine fuses the input norms into linear_qkv / linear_fc1 (`layer_norm_weight`); both namings map.
- critic: output_layer.{weight,bias} <-> HF `score.{weight,bias}` (AutoModelForTokenClassification, 1 label).

HF -> Megatron (`load_hf_weights`) reads only this rank's slices from the safetensors files, tensor by tensor.
Megatron -> HF (`iter_hf_weights`) yields full HF tensors one at a time: the owning PP stage all-gathers its TP
shards, un-fuses them, strips vocab padding, and broadcasts each tensor to the other PP stages.
"""
from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.atomic import atomic_directory
from mppo.models.builders import ValueHead, unwrap_model
from mppo.models.hf_config import HFModelArgs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")

# megatron layer-local suffix -> (how it is sharded/fused, HF suffixes under model.layers.{L}.)
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
_LAYER_ORDER = {suffix: i for i, suffix in enumerate(_LAYER_RULES)}
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class WeightRule:
    """How one megatron parameter relates to HF tensors. `order` sorts parameters into HF order."""

    kind: str  # replicated | vocab | row | qkv | fc1
    hf_names: tuple[str, ...]
    order: tuple[int, int, int]


def weight_rule(model: nn.Module, name: str) -> WeightRule | None:
    """The rule for parameter `name` of a GPTModel chunk; None for a tied output layer (a copy of the embedding).

    Layer indices in `name` are chunk-local; the HF name uses the global layer (megatron's 1-based layer_number).
    """
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    if name == "embedding.word_embeddings.weight":
        return WeightRule("vocab", ("model.embed_tokens.weight",), (0, 0, 0))
    if name == "decoder.final_layernorm.weight":
        return WeightRule("replicated", ("model.norm.weight",), (2, 0, 0))
    if isinstance(getattr(model, "output_layer", None), ValueHead):
        if name in ("output_layer.weight", "output_layer.bias"):
            return WeightRule("replicated", ("score." + name.split(".")[-1],), (3, 0, int(name.endswith("bias"))))
    if name == "output_layer.weight":
        return None if tied else WeightRule("vocab", ("lm_head.weight",), (3, 0, 0))
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_RULES:
        layer = model.decoder.layers[int(match.group(1))].layer_number - 1
        kind, suffixes = _LAYER_RULES[match.group(2)]
        return WeightRule(kind, tuple(f"model.layers.{layer}.{s}" for s in suffixes),
                          (1, layer, _LAYER_ORDER[match.group(2)]))
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")


def _tp() -> tuple[int, int, dist.ProcessGroup]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_group()


# ---------------------------------------------------------------------------------------------- HF -> Megatron
class SafetensorsCheckpoint:
    """Lazy access to the tensors of an HF safetensors checkpoint (one file or an index of shards)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {self.dir}")
        self._stack = ExitStack()
        self._files: dict[str, object] = {}
        if weight_map is None:
            handle = self._stack.enter_context(safe_open(self.dir / "model.safetensors", framework="pt"))
            self._where = {k: handle for k in handle.keys()}
        else:
            self._where = {}
            for name, file in weight_map.items():
                if file not in self._files:
                    self._files[file] = self._stack.enter_context(safe_open(self.dir / file, framework="pt"))
                self._where[name] = self._files[file]

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def slice(self, name: str):
        """safetensors slice object: index it (`[a:b]`, `[:, a:b]`) to read only those rows/columns."""
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is missing from the HF checkpoint in {self.dir}")
        return self._where[name].get_slice(name)

    def close(self) -> None:
        self._stack.close()


def _read_shard(ckpt: SafetensorsCheckpoint, rule: WeightRule, args: HFModelArgs, param: torch.Tensor,
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


def load_hf_weights(model_chunks: Sequence[nn.Module], hf_dir: str | Path, args: HFModelArgs) -> None:
    """Copy an HF checkpoint into this rank's TP/PP shards, streaming one tensor slice at a time.

    A tied output layer on the last stage (PP > 1) loads the embedding. A critic's value head loads HF
    `score.weight`/`score.bias` when present (a critic checkpoint) and otherwise keeps its zero initialisation.
    """
    tp_rank, tp, _ = _tp()
    ckpt = SafetensorsCheckpoint(hf_dir)
    try:
        with torch.no_grad():
            for chunk in model_chunks:
                model = unwrap_model(chunk)
                for name, param in model.named_parameters():
                    rule = weight_rule(model, name)
                    if rule is None:  # tied output layer on the last stage: a copy of the embedding
                        rule = WeightRule("vocab", ("model.embed_tokens.weight",), (3, 0, 0))
                    if rule.hf_names[0].startswith("score.") and rule.hf_names[0] not in ckpt:
                        continue
                    shard = _read_shard(ckpt, rule, args, param, tp_rank, tp)
                    if tuple(shard.shape) != tuple(param.shape):
                        raise ValueError(
                            f"{name}: HF tensors {rule.hf_names} give shape {tuple(shard.shape)} at tp rank "
                            f"{tp_rank}, the model expects {tuple(param.shape)}; does the config match the weights?")
                    param.copy_(shard)
    finally:
        ckpt.close()


# ---------------------------------------------------------------------------------------------- Megatron -> HF
def _full_shapes(rule: WeightRule, local: torch.Size, args: HFModelArgs, tp: int) -> list[tuple[int, ...]]:
    rest = tuple(local[1:])
    if rule.kind == "replicated":
        return [tuple(local)]
    if rule.kind == "vocab":
        return [(args.vocab_size, *rest)]
    if rule.kind == "row":
        return [(local[0], local[1] * tp)]
    if rule.kind == "fc1":
        return [(local[0] // 2 * tp, *rest)] * 2
    d, groups = args.head_dim, args.num_query_groups
    return [(args.num_attention_heads * d, *rest), (groups * d, *rest), (groups * d, *rest)]


def _unshard(rule: WeightRule, shards: list[torch.Tensor], args: HFModelArgs) -> list[torch.Tensor]:
    """Full HF tensors from the TP shards of one megatron parameter (shards in TP rank order)."""
    if rule.kind == "replicated":
        return [shards[0]]
    if rule.kind == "vocab":
        return [torch.cat(shards)[:args.vocab_size]]
    if rule.kind == "row":
        return [torch.cat(shards, dim=1)]
    if rule.kind == "fc1":
        halves = [s.chunk(2) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    d, qpg = args.head_dim, args.heads_per_group
    full = torch.cat(shards)
    rest = tuple(full.shape[1:])
    grouped = full.reshape(args.num_query_groups, (qpg + 2) * d, *rest)
    q, k, v = grouped.split([qpg * d, d, d], dim=1)
    return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]


def iter_hf_weights(model_chunks: Sequence[nn.Module], args: HFModelArgs, *,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` in HF order on EVERY rank (collective: all ranks must consume it all).

    Tensors live on the model's device, in `dtype` if given (else the parameter dtype). Only one megatron
    parameter's worth of full tensors exists at a time.
    """
    from megatron.core import parallel_state as ps

    tp_rank, tp, tp_group = _tp()
    pp_group, pp = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()

    local: dict[tuple[int, int, int], tuple[WeightRule, torch.Tensor]] = {}
    plan = []  # (order, pp_rank, hf_names, full shapes, dtype name), the same on every rank after the gather
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for name, param in model.named_parameters():
            rule = weight_rule(model, name)
            if rule is None:
                continue
            local[rule.order] = (rule, param)
            out_dtype = dtype or param.dtype
            plan.append((rule.order, pp_rank, rule.hf_names, _full_shapes(rule, param.shape, args, tp),
                         str(out_dtype).removeprefix("torch.")))
    if pp > 1:
        gathered: list = [None] * pp
        dist.all_gather_object(gathered, plan, group=pp_group)
        plan = [entry for stage in gathered for entry in stage]
    plan.sort(key=lambda entry: entry[0])

    device = next(iter(local.values()))[1].device
    for order, owner, hf_names, shapes, dtype_name in plan:
        out_dtype = getattr(torch, dtype_name)
        if owner == pp_rank:
            rule, param = local[order]
            shard = param.detach()
            if tp > 1:
                shards = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(shards, shard.contiguous(), group=tp_group)
            else:
                shards = [shard]
            tensors = [t.to(out_dtype).contiguous() for t in _unshard(rule, shards, args)]
        else:
            tensors = [torch.empty(shape, dtype=out_dtype, device=device) for shape in shapes]
        for hf_name, tensor in zip(hf_names, tensors):
            if pp > 1:
                dist.broadcast(tensor, src=dist.get_global_rank(pp_group, owner), group=pp_group)
            yield hf_name, tensor


def bucketed(named_tensors: Iterable[tuple[str, torch.Tensor]],
             bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group `(name, tensor)` pairs into lists of at most `bucket_bytes` bytes, in order.

    A tensor larger than `bucket_bytes` on its own cannot be split and forms a bucket by itself.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def save_hf_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, args: HFModelArgs,
                       *, tokenizer_dir: str | Path | None = None, max_shard_bytes: int = 2 << 30,
                       dtype: torch.dtype | None = None, overwrite: bool = False) -> None:
    """Write HF safetensors shards + index, config.json and (when found in `tokenizer_dir`) tokenizer files.

    `dtype` only records the tensors' dtype in config.json (cast them with iter_hf_weights(dtype=...)).

    Collective when torch.distributed is initialised: every rank must call it with the same generator (it is
    consumed everywhere); only global rank 0 writes. The directory appears atomically.
    """
    from safetensors.torch import save_file

    writer = not dist.is_initialized() or dist.get_rank() == 0
    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        shard_files: list[tuple[str, list[str]]] = []
        total = 0

        def flush(bucket: list[tuple[str, torch.Tensor]]) -> None:
            nonlocal total
            name = f"part-{len(shard_files):05d}.safetensors"
            save_file({k: t.detach().cpu().contiguous() for k, t in bucket}, str(tmp / name),
                      metadata={"format": "pt"})
            shard_files.append((name, [k for k, _ in bucket]))
            total += sum(t.numel() * t.element_size() for _, t in bucket)

        if writer:
            for bucket in bucketed(((n, t.cpu()) for n, t in named_tensors), max_shard_bytes):
                flush(bucket)
            _finish_hf_dir(tmp, shard_files, total, args, tokenizer_dir, dtype)
        else:
            for _ in named_tensors:  # the collectives inside the generator need every rank
                pass


def write_hf_metadata(out_dir: Path, args: HFModelArgs, tokenizer_dir: str | Path | None,
                      dtype: torch.dtype | None = None) -> None:
    """config.json (as read from the source; with `dtype`, stating that weight dtype) and the tokenizer files
    that exist in `tokenizer_dir`."""
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(args.raw)
    if dtype is not None:
        key = "dtype" if "dtype" in config else "torch_dtype"  # transformers 5 / 4 spelling
        config[key] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, out_dir / name)


def _finish_hf_dir(tmp: Path, shard_files: list[tuple[str, list[str]]], total: int, args: HFModelArgs,
                   tokenizer_dir: str | Path | None, dtype: torch.dtype | None) -> None:
    if len(shard_files) == 1:
        (tmp / shard_files[0][0]).rename(tmp / "model.safetensors")
    else:
        weight_map = {}
        for i, (name, keys) in enumerate(shard_files):
            final = f"model-{i + 1:05d}-of-{len(shard_files):05d}.safetensors"
            (tmp / name).rename(tmp / final)
            weight_map.update({k: final for k in keys})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_hf_metadata(tmp, args, tokenizer_dir, dtype)
