"""LoRA adapters <-> HF PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`).

PEFT's format (peft docs, developer_guides/checkpoint.md): tensor keys are the PeftModel's state-dict names with the
adapter name dropped, `base_model.model.<HF module>.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank];
adapter_config.json holds peft_type LORA, r, lora_alpha, lora_dropout, target_modules and the base model.
`peft.PeftModel.from_pretrained(hf_base, dir)` loads it. mppo's adapters are per HF projection already
(mppo.models.lora), so the full PEFT tensors are the TP shards put together: B by rows (column-parallel linears),
A by columns (row-parallel), the replicated ones as they are.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.atomic import atomic_directory
from mppo.models.lora import LinearAdapters, LoRASpec, iter_adapters

PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_key(adapters: LinearAdapters, projection: str, which: str) -> str:
    """PEFT's tensor key of one adapter matrix (`which`: lora_A or lora_B)."""
    return f"{PEFT_PREFIX}{adapters.hf_prefix}.{projection}.{which}.weight"


def _split_axis(adapters: LinearAdapters, which: str) -> int | None:
    """The TP-split axis of an adapter matrix; None: replicated."""
    if adapters.kind == "column":
        return 0 if which == "lora_B" else None
    return 1 if which == "lora_A" else None


def load_peft_tensors(model_chunks: Sequence[nn.Module], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy full PEFT adapter tensors into this rank's adapter shards (every adapter of the chunks must be there)."""
    from megatron.core import parallel_state as ps

    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for adapters in iter_adapters(model_chunks):
            for proj in adapters.projections:
                for which, params in (("lora_A", adapters.lora_A), ("lora_B", adapters.lora_B)):
                    key = peft_key(adapters, proj, which)
                    if key not in tensors:
                        raise KeyError(f"the adapter tensors have no {key}; were they saved for this model and "
                                       "these target modules?")
                    full, param, axis = tensors[key], params[proj], _split_axis(adapters, which)
                    if axis is not None and not adapters.expert:  # experts are whole (expert-TP 1)
                        size = full.shape[axis] // tp
                        full = full.narrow(axis, tp_rank * size, size)
                    if tuple(full.shape) != tuple(param.shape):
                        raise ValueError(f"{key}: shape {tuple(full.shape)} at tp rank {tp_rank}, the adapter has "
                                         f"{tuple(param.shape)}; another rank or model?")
                    param.copy_(full)


def gather_peft_tensors(model_chunks: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """Every adapter as a full PEFT tensor (CPU, fp32), on every rank (collective over the world: TP gathers, then
    one all_gather_object of the stages' adapters; DP replicas hold the same ones, DP rank 0's are taken; a MoE
    expert's adapters come from expert-data-parallel rank 0 of the EP rank that holds the expert)."""
    from megatron.core import parallel_state as ps

    tp, tp_group = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_group()
    mine: dict[str, torch.Tensor] = {}
    experts: set[str] = set()
    for adapters in iter_adapters(model_chunks):
        for proj in adapters.projections:
            for which, params in (("lora_A", adapters.lora_A), ("lora_B", adapters.lora_B)):
                shard, axis = params[proj].detach().contiguous(), _split_axis(adapters, which)
                if axis is not None and tp > 1 and not adapters.expert:  # experts are whole (expert-TP 1)
                    parts = [torch.empty_like(shard) for _ in range(tp)]
                    dist.all_gather(parts, shard, group=tp_group)
                    shard = torch.cat(parts, dim=axis)
                key = peft_key(adapters, proj, which)
                mine[key] = shard.float().cpu()
                if adapters.expert:
                    experts.add(key)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    leader = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    expert_leader = ps.get_expert_tensor_parallel_rank() == 0 and ps.get_expert_data_parallel_rank() == 0
    ours = {k: v for k, v in mine.items() if (expert_leader if k in experts else leader)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, ours)
    return {k: v for part in every for k, v in part.items()}


def has_expert_adapters(model_chunks: Sequence[nn.Module]) -> bool:
    """Whether MoE experts carry adapters: PEFT cannot load those on transformers' Qwen3-MoE, whose experts are
    fused 3D parameters rather than per-expert linears."""
    return any(a.expert for a in iter_adapters(model_chunks))


def adapter_config(spec: LoRASpec, base_model: str | None) -> dict:
    """PEFT's adapter_config.json for these adapters (the keys LoraConfig reads; the rest take PEFT's defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout,
            "target_modules": list(spec.projections), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}


def save_peft_adapter(tensors: Mapping[str, torch.Tensor], out_dir: str | Path, spec: LoRASpec, *,
                      base_model: str | None = None, overwrite: bool = False) -> None:
    """Write a PEFT adapter directory (atomically; global rank 0 writes, every rank must call it)."""
    from safetensors.torch import save_file

    with atomic_directory(out_dir, overwrite=overwrite) as tmp:
        if not dist.is_initialized() or dist.get_rank() == 0:
            save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(tmp / WEIGHTS_FILE),
                      metadata={"format": "pt"})
            (tmp / CONFIG_FILE).write_text(json.dumps(adapter_config(spec, base_model), indent=2))


def read_peft_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{adapter_dir} is not a PEFT adapter directory: {CONFIG_FILE} is missing")
    return json.loads((adapter_dir / CONFIG_FILE).read_text()), load_file(str(adapter_dir / WEIGHTS_FILE))


# ----------------------------------------------------------------------------------------- checkpoints
LORA_META = "lora.json"  # in a checkpoint directory of a LoRA model: the adapters' spec and their base
_DIGESTS: dict[tuple, str] = {}


def base_digest(hf_dir: str | Path) -> str:
    """A digest of the base model's weights and config (blake2b over config.json and every *.safetensors file's
    bytes); computed once per process and directory state (a 7B base reads ~15 GB once)."""
    import hashlib

    root = Path(hf_dir).resolve()
    files = [root / "config.json", *sorted(root.glob("*.safetensors"))]
    stamp = (str(root), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()))
    if stamp not in _DIGESTS:
        h = hashlib.blake2b(digest_size=16)
        for f in files:
            if f.is_file():
                h.update(f.name.encode())
                with f.open("rb") as handle:
                    while chunk := handle.read(1 << 24):
                        h.update(chunk)
        _DIGESTS[stamp] = h.hexdigest()
    return _DIGESTS[stamp]


def write_lora_meta(ckpt_dir: Path, spec: LoRASpec, base_dir: str | Path) -> None:
    """lora.json: the spec and the base model's directory and digest (so a resume on another base is refused)."""
    meta = {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "projections": list(spec.projections),
            "seed": spec.seed, "base_path": str(Path(base_dir).resolve()), "base_digest": base_digest(base_dir)}
    (ckpt_dir / LORA_META).write_text(json.dumps(meta, indent=1))


def read_lora_meta(ckpt_dir: str | Path) -> dict | None:
    """A checkpoint's lora.json, None for a full-weight checkpoint."""
    path = Path(ckpt_dir) / LORA_META
    return json.loads(path.read_text()) if path.is_file() else None


def spec_of(meta: dict) -> LoRASpec:
    return LoRASpec(rank=meta["rank"], alpha=meta["alpha"], dropout=meta["dropout"],
                    projections=tuple(meta["projections"]), seed=meta["seed"])


def lora_mismatch(ckpt_dir: str | Path, spec: LoRASpec | None, base_dir: str | Path | None) -> str | None:
    """Why a checkpoint cannot load into a model with these adapters on this base (None: it can)."""
    meta = read_lora_meta(ckpt_dir)
    if meta is None and spec is None:
        return None
    if meta is None or spec is None:
        return ("the checkpoint holds LoRA adapters and this model has none (set actor_rollout_ref.model.lora as "
                "saved)" if spec is None else "the checkpoint holds full weights and this model trains LoRA "
                "adapters (set actor_rollout_ref.model.lora.rank=0 to resume it)")
    saved = spec_of(meta)
    if (saved.rank, saved.projections) != (spec.rank, spec.projections):
        return (f"LoRA rank {saved.rank} on {list(saved.projections)} (checkpoint) vs rank {spec.rank} on "
                f"{list(spec.projections)} (this model); use the saved lora settings")
    if base_digest(base_dir) != meta["base_digest"]:
        return (f"the adapters were trained on the base {meta['base_path']} (digest {meta['base_digest']}), this "
                f"model's base {Path(base_dir).resolve()} has another digest; resume on the same base model")
    return None
