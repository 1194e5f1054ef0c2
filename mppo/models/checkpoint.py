"""Model checkpoints in megatron's dist_checkpointing format, loadable at any TP/PP layout.

Layout of a model checkpoint directory:
    <dir>/model/   dist_checkpointing files (sharded state of every model chunk)
    <dir>/hf/      config.json (+ tokenizer files when known): enough to rebuild the model and export to HF

Every save goes through `save_sharded`: dist_checkpointing.save, synchronous, with megatron's write results kept in
the saving process (see there).
"""
from __future__ import annotations

import queue
from pathlib import Path
from typing import Sequence

import torch.distributed as dist
from torch import nn

from mppo.models.atomic import atomic_directory
from mppo.models.builders import unwrap_model
from mppo.models.hf_config import HFModelArgs
from mppo.models.lora import is_adapter_parameter, lora_info
from mppo.models.pickle_vetting import vet_checkpoint_dir
from mppo.models.weights import write_hf_metadata

MODEL_SUBDIR = "model"
HF_SUBDIR = "hf"
TRAINER_ROLES = ("actor", "critic")  # the worker checkpoints inside a trainer's checkpoints/global_step_N/


def model_sharded_state_dict(model_chunks: Sequence[nn.Module]) -> dict:
    """Megatron-LM's convention: {"model": ...} for one chunk, {"model0": ..., "model1": ...} for vpp.

    Tensors are keyed by global layer inside, so a checkpoint written with or without vpp loads either way.
    """
    def state(chunk: nn.Module) -> dict:
        full = unwrap_model(chunk).sharded_state_dict()
        if lora_info(model_chunks) is None:
            return full
        # LoRA: the adapters only; the frozen base comes from its HF directory (lora.json names it)
        return {k: v for k, v in full.items() if is_adapter_parameter(k)}

    if len(model_chunks) == 1:
        return {"model": state(model_chunks[0])}
    return {f"model{i}": state(chunk) for i, chunk in enumerate(model_chunks)}


def load_chunk_state(chunk: nn.Module, state: dict) -> None:
    """load_state_dict(strict) of one chunk; of a LoRA chunk, its adapters only (the base stays as loaded)."""
    model = unwrap_model(chunk)
    if getattr(model, "lora_info", None) is None:
        model.load_state_dict(state, strict=True)
        return
    missing, unexpected = model.load_state_dict(state, strict=False)
    adapters_missing = [k for k in missing if is_adapter_parameter(k)]
    if adapters_missing or unexpected:
        raise KeyError(f"LoRA checkpoint: missing adapters {adapters_missing[:3]}, unexpected keys {unexpected[:3]}")


def save_sharded(sharded_state: dict, directory: str | Path) -> None:
    """`dist_checkpointing.save(sharded_state, directory)` (collective).

    The save is synchronous: megatron's writer runs in this process (its forked writers hand their results back to
    it), so the results need no queue between processes. Megatron's default is one for its asynchronous saves, a
    multiprocessing Manager in a spawned process: per rank a process that imports torch at the first save (~3 s
    of CPU) and that would outlive a killed rank, holding the launcher's output pipe open (`torchrun ... | tee`
    would never end). An in-process queue takes its place, once per process.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:  # megatron creates it lazily (_get_write_results_queue)
        filesystem_async._results_queue = queue.Queue()  # put / get_nowait, as the Manager's proxy
    dist_checkpointing.save(sharded_state, str(directory))


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_model_checkpoint(model_chunks: Sequence[nn.Module], ckpt_dir: str | Path, args: HFModelArgs, *,
                          tokenizer_dir: str | Path | None = None, overwrite: bool = False) -> None:
    """Write the model as a dist checkpoint plus its HF config (collective; atomic)."""
    with atomic_directory(ckpt_dir, overwrite=overwrite) as tmp:
        if _is_writer():
            (tmp / MODEL_SUBDIR).mkdir()
        if dist.is_initialized():
            dist.barrier()
        save_sharded(model_sharded_state_dict(model_chunks), tmp / MODEL_SUBDIR)
        if _is_writer():
            write_hf_metadata(tmp / HF_SUBDIR, args, tokenizer_dir)


def checkpoint_hf_dir(ckpt_dir: str | Path) -> Path:
    """The directory with the checkpoint's config.json (pass it to read_hf_config / build_gpt_model)."""
    path = Path(ckpt_dir) / HF_SUBDIR
    if not (path / "config.json").is_file():
        roles = [role for role in TRAINER_ROLES if (Path(ckpt_dir) / role / HF_SUBDIR / "config.json").is_file()]
        if roles:
            raise FileNotFoundError(f"{ckpt_dir} is a training run's step directory, not a model checkpoint: give "
                                    f"one of its models, e.g. --ckpt {Path(ckpt_dir) / roles[0]} (has: "
                                    f"{', '.join(roles)})")
        raise FileNotFoundError(f"{ckpt_dir} is not an mppo model checkpoint: {path}/config.json is missing")
    return path


def load_model_checkpoint(model_chunks: Sequence[nn.Module], ckpt_dir: str | Path) -> None:
    """Load a dist checkpoint saved at any TP/PP layout into these (already built) chunks (collective).

    Its pickles are vetted first (`mppo.models.pickle_vetting`): UnsafeCheckpointError names a file that could
    run code."""
    from megatron.core import dist_checkpointing

    model_dir = Path(ckpt_dir) / MODEL_SUBDIR
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{ckpt_dir} is not an mppo model checkpoint: {model_dir} is missing")
    vet_checkpoint_dir(model_dir)  # dist_checkpointing unpickles .metadata and byte entries with no allowlist
    state = dist_checkpointing.load(model_sharded_state_dict(model_chunks), str(model_dir))
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    for chunk, key in zip(model_chunks, keys):
        load_chunk_state(chunk, state[key])
