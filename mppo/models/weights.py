"""HF <-> Megatron weights. One exporter feeds the rollout weight sync, `mppo convert` and HF checkpoints.

The layout mapping (names, TP sharding, fused QKV / gate-up, vocabulary padding) is mppo.models.weight_rules.

HF -> Megatron (`load_hf_weights`) reads only this rank's slices from the safetensors files, tensor by tensor (of
a MoE model only the experts of this rank's EP index).
Megatron -> HF (`iter_hf_weights`, from mppo.models.weight_export) yields full HF tensors on the destination ranks,
by collectives (any backend) or, for gloo ranks on one host, through shared-memory staging
(mppo.models.weight_transport).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.atomic import atomic_directory
from mppo.models.builders import unwrap_model
from mppo.models.hf_config import HFModelArgs
from mppo.models.weight_export import iter_hf_weights
from mppo.models.weight_rules import WeightRule, read_shard, tp_layout, weight_rule

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


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


def load_hf_weights(model_chunks: Sequence[nn.Module], hf_dir: str | Path, args: HFModelArgs) -> None:
    """Copy an HF checkpoint into this rank's TP/PP shards, streaming one tensor slice at a time.

    A tied output layer on the last stage (PP > 1) loads the embedding. A critic's value head loads HF
    `score.weight`/`score.bias` when present (a critic checkpoint) and otherwise keeps its zero initialisation.
    """
    layouts = {expert: tp_layout(expert)[:2] for expert in (False, True)}
    ckpt = SafetensorsCheckpoint(hf_dir)
    try:
        with torch.no_grad():
            for chunk in model_chunks:
                model = unwrap_model(chunk)
                for name, param in model.named_parameters():
                    rule = weight_rule(model, name)
                    if rule is None:  # tied output layer on the last stage: a copy of the embedding
                        rule = WeightRule("vocab", ("model.embed_tokens.weight",), (3, 0, 0, -1))
                    if rule.hf_names[0].startswith("score.") and rule.hf_names[0] not in ckpt:
                        continue
                    tp_rank, tp = layouts[rule.expert]
                    shard = read_shard(ckpt, rule, args, param, tp_rank, tp)
                    if tuple(shard.shape) != tuple(param.shape):
                        raise ValueError(
                            f"{name}: HF tensors {rule.hf_names} give shape {tuple(shard.shape)} at tp rank "
                            f"{tp_rank}, the model expects {tuple(param.shape)}; does the config match the weights?")
                    param.copy_(shard)
    finally:
        ckpt.close()


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
        nbytes = tensor.nbytes
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
    that exist in `tokenizer_dir`, with the checkpoint's own code files when it has an auto_map."""
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(args.raw)
    if dtype is not None:
        key = "dtype" if "dtype" in config else "torch_dtype"  # transformers 5 / 4 spelling
        config[key] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer_dir is not None:
        from mppo.models.remote_code import custom_code_files

        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copy2(Path(tokenizer_dir) / name, out_dir / name)
        for source in custom_code_files(tokenizer_dir):  # config.json's auto_map, kept above, names these files
            shutil.copy2(source, out_dir / source.name)


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


__all__ = ["TOKENIZER_FILES", "SafetensorsCheckpoint", "bucketed", "iter_hf_weights", "load_hf_weights",
           "save_hf_checkpoint", "write_hf_metadata"]
