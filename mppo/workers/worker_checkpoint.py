"""Worker checkpoints: model, optimizer, LR schedule, RNG states and the trainer's extra state, written atomically.

Directory layout (a superset of `mppo.models.checkpoint`'s, so `mppo convert mcore-to-hf --ckpt DIR` and
`load_model_checkpoint` read the weights of a worker checkpoint too):
    <dir>/model/              megatron dist_checkpointing: the model chunks and, for trainable workers, the
                              optimizer state (one `dist_checkpointing.save`)
    <dir>/hf/                 config.json (+ tokenizer files): enough to rebuild the model
    <dir>/worker_state.json   role, model facts, parallel layout, LR schedule, the caller's `extra_state`
    <dir>/rng/rank{R}.json    RNG states of every global rank (python, numpy, torch, CUDA, megatron tracker)
Nothing is pickled by mppo: small state is JSON, tensors go through dist_checkpointing.

Resharding (what a checkpoint saved at one layout loads into):
- model weights: any TP / PP / virtual PP (dist_checkpointing reshards them);
- optimizer, non-distributed: any TP / PP / DP (its state is keyed like the parameters);
- optimizer, distributed (`dp_reshardable` format): the same TP, PP and virtual PP only (DP may change);
- RNG states: the identical layout only (they are per rank).
Anything else raises CheckpointMismatchError naming what differs and the way out (load_optimizer=False /
load_rng=False), before any tensor is read.
"""
from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mppo.errors import UserError
from mppo.models.atomic import atomic_directory
from mppo.models.builders import unwrap_model
from mppo.models.checkpoint import HF_SUBDIR, MODEL_SUBDIR, load_chunk_state, model_sharded_state_dict, save_sharded
from mppo.models.lora import lora_info
from mppo.models.lora_io import lora_mismatch, write_lora_meta
from mppo.models.pickle_vetting import vet_checkpoint_dir
from mppo.models.weights import write_hf_metadata

FORMAT_VERSION = 1
STATE_FILE = "worker_state.json"
RNG_SUBDIR = "rng"
# The distributed optimizer's format: each bucket's state as flat tensors, reshardable over DP
# (megatron-core's default format fails on CPU; `fully_reshardable` needs apex/TE, see gpu_stack_on_cpu.md).
DIST_OPT_FORMAT = "dp_reshardable"
_MODEL_FACTS = ("model_type", "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                "num_query_groups", "head_dim", "qkv_bias", "tie_word_embeddings")


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint that cannot be loaded into this worker as asked."""


@dataclass
class LoadedCheckpoint:
    """What `load_worker_checkpoint` restored."""

    extra_state: dict[str, Any]
    optimizer_loaded: bool
    rng_loaded: bool
    saved_layout: dict[str, Any] = field(default_factory=dict)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# --------------------------------------------------------------------------------------------------- RNG states
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """Every RNG state of this process as JSON-able data."""
    from megatron.core import tensor_parallel

    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": [version, list(mt), gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": _b64(torch.get_rng_state()),
        "cuda": _b64(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None,
        "tracker": {k: _b64(v) for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"]))
    tensor_parallel.get_cuda_rng_tracker().set_states({k: _unb64(v) for k, v in state["tracker"].items()})


# --------------------------------------------------------------------------------------------------- save
def _role(worker) -> str:
    return type(worker).__name__.removesuffix("Worker").lower()  # actor | critic | reference


def _layout(worker) -> dict[str, Any]:
    dims = worker.dims
    optimizer = getattr(worker, "optimizer", None)
    return {"tp": dims.tp, "pp": dims.pp, "vpp": dims.vpp, "dp": dims.dp, "cp": dims.cp,
            "padded_vocab_size": unwrap_model(worker.model[0]).vocab_size,
            "distributed_optimizer": bool(optimizer is not None and _is_distributed(optimizer))}


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(p, DistributedOptimizer) for p in _inner_optimizers(optimizer))


def _optimizer_metadata(optimizer) -> dict | None:
    return {"distrib_optim_sharding_type": DIST_OPT_FORMAT} if _is_distributed(optimizer) else None


def _inner_optimizers(optimizer) -> list:
    from megatron.core.optimizer import ChainedOptimizer

    return optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]


def _ensure_optimizer_state(optimizer) -> None:
    """Create Adam's state of an optimizer that has not stepped yet, as torch's AdamW does at its first step.

    Without apex/TE, megatron-core's DistributedOptimizer.state_dict() reads a 'step' from every parameter's
    state, which torch's AdamW creates lazily: a fresh optimizer could neither save nor load a checkpoint.
    """
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        # only torch's own Adam(W): TE/apex FusedAdam keep the step in their param groups
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or any(len(s) for s in inner.state.values()):
            continue
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _adam_step(optimizer) -> float | None:
    """The Adam step count of torch's AdamW (kept per parameter; megatron requires them all equal)."""
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                return float(state["step"])
    return None


def _restore_adam_step(optimizer, step: float | None) -> None:
    """Give every parameter its own Adam 'step' tensor with the saved count.

    megatron-core 0.16's DistributedOptimizer.load_state_dict (without apex/TE) puts ONE step tensor into every
    parameter's state and then overwrites it while copying the per-bucket state, so after a resume the step is
    wrong, and torch's AdamW would increment the shared tensor once per parameter. TE/apex FusedAdam keep the
    step in the param groups instead (no per-parameter tensor, nothing to do).
    """
    if step is None:
        return
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        for state in (inner.state.values() if inner is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)


def _sharded_state(worker, *, with_optimizer: bool, is_loading: bool) -> dict:
    state = model_sharded_state_dict(worker.model)
    if with_optimizer:
        optimizer = worker.optimizer
        _ensure_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading,
                                                          metadata=_optimizer_metadata(optimizer))
    return state


def save_worker_checkpoint(worker, ckpt_dir: str | Path, *, extra_state: dict[str, Any] | None = None,
                           tokenizer_dir: str | Path | None = None, overwrite: bool = False) -> None:
    """Save an Actor/Critic/ReferenceWorker (collective; the directory appears atomically).

    `extra_state`: small JSON-serialisable data of the caller (trainer step, data position, ...), returned by
    `load_worker_checkpoint`.
    """
    extra = json.loads(json.dumps(extra_state or {}))  # fail early (on every rank) if it is not JSON
    optimizer = getattr(worker, "optimizer", None)
    scheduler = getattr(worker, "scheduler", None)
    with atomic_directory(ckpt_dir, overwrite=overwrite) as tmp:
        if _rank() == 0:
            (tmp / MODEL_SUBDIR).mkdir()
            (tmp / RNG_SUBDIR).mkdir()
        _barrier()
        save_sharded(_sharded_state(worker, with_optimizer=optimizer is not None, is_loading=False), tmp / MODEL_SUBDIR)
        rng = {"coords": [worker.dims.tp_rank, worker.dims.pp_rank, worker.dims.dp_rank],
               "state": capture_rng_state()}
        (tmp / RNG_SUBDIR / f"rank{_rank()}.json").write_text(json.dumps(rng))
        if _rank() == 0:
            write_hf_metadata(tmp / HF_SUBDIR, worker.hf_args, tokenizer_dir)
            if (info := lora_info(worker.model)) is not None:  # adapters only: name the base they need
                write_lora_meta(tmp, info.spec, info.base_dir)
            state = {"format": FORMAT_VERSION, "role": _role(worker),
                     "model": {k: getattr(worker.hf_args, k) for k in _MODEL_FACTS},
                     "layout": _layout(worker), "has_optimizer": optimizer is not None,
                     "optimizer_step": _adam_step(optimizer) if optimizer is not None else None,
                     "lr_scheduler": scheduler.state_dict() if scheduler is not None else None, "extra": extra}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))


# --------------------------------------------------------------------------------------------------- load
def read_worker_state(ckpt_dir: str | Path) -> dict[str, Any]:
    """The checkpoint's worker_state.json (role, model facts, layout, LR schedule, extra state)."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file() or not (Path(ckpt_dir) / MODEL_SUBDIR).is_dir():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete mppo worker checkpoint ({STATE_FILE} or "
                                f"{MODEL_SUBDIR}/ is missing)")
    state = json.loads(path.read_text())
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointMismatchError(f"{ckpt_dir}: checkpoint format {state.get('format')} is not the supported "
                                      f"format {FORMAT_VERSION}")
    return state


def _differences(saved: dict, current: dict, keys) -> list[str]:
    return [f"{k} {saved.get(k)!r} (checkpoint) vs {current.get(k)!r} (this worker)"
            for k in keys if saved.get(k) != current.get(k)]


def check_compatible(state: dict[str, Any], worker, *, load_optimizer: bool, load_rng: bool) -> None:
    """Raise CheckpointMismatchError (naming every difference and the fix) unless `state` loads as asked."""
    model_diff = _differences(state["model"], {k: getattr(worker.hf_args, k) for k in _MODEL_FACTS}, _MODEL_FACTS)
    saved_head, head = state["role"] == "critic", _role(worker) == "critic"
    if saved_head != head:
        model_diff.append(f"a {state['role']} checkpoint cannot load into a {_role(worker)} (value head vs LM head)")
    saved, current = state["layout"], _layout(worker)
    model_diff += _differences(saved, current, ("padded_vocab_size",))
    if model_diff:
        raise CheckpointMismatchError("the checkpoint holds another model: " + "; ".join(model_diff))
    problems = []
    if load_optimizer:
        if not state["has_optimizer"] or getattr(worker, "optimizer", None) is None:
            problems.append("optimizer state: the checkpoint or this worker has no optimizer "
                            "(pass load_optimizer=False)")
        elif saved["distributed_optimizer"] != current["distributed_optimizer"]:
            problems.append(f"optimizer state: saved with use_distributed_optimizer={saved['distributed_optimizer']},"
                            f" this worker uses {current['distributed_optimizer']} (use the same setting, or pass "
                            "load_optimizer=False to load weights only)")
        elif saved["distributed_optimizer"]:
            diff = _differences(saved, current, ("tp", "pp", "vpp"))
            if diff:
                problems.append("distributed-optimizer state reshards across DP only, and the layout differs: "
                                + ", ".join(diff) + " (resume at the saved TP/PP/VPP, or pass load_optimizer=False)")
    if load_rng:
        diff = _differences({"cp": 1, **saved}, current, ("tp", "pp", "vpp", "dp", "cp"))  # older ones: CP 1
        if diff:
            problems.append("RNG states are per rank and the layout differs: " + ", ".join(diff)
                            + " (pass load_rng=False)")
    if problems:
        raise CheckpointMismatchError("cannot load the checkpoint as asked: " + "; ".join(problems))


def load_worker_checkpoint(worker, ckpt_dir: str | Path, *, load_optimizer: bool | None = None,
                           load_rng: bool = True) -> LoadedCheckpoint:
    """Load a worker checkpoint (collective). Model weights load at any TP/PP; the optimizer, LR schedule and
    RNG states as the module docstring says.

    `load_optimizer=None` loads the optimizer state and LR schedule when this worker has an optimizer (the
    checkpoint must then have one too). Without them, the optimizer's master weights are refreshed from the
    loaded model (bf16) and the LR schedule is left as it is.
    """
    from megatron.core import dist_checkpointing

    vet_checkpoint_dir(Path(ckpt_dir) / MODEL_SUBDIR)  # each rank vets what it reads (the trainer's verify did too)
    if load_optimizer is None:
        load_optimizer = getattr(worker, "optimizer", None) is not None
    state = read_worker_state(ckpt_dir)
    check_compatible(state, worker, load_optimizer=load_optimizer, load_rng=load_rng)
    info = lora_info(worker.model)  # LoRA: the same adapters on the same base
    problem = lora_mismatch(ckpt_dir, info and info.spec, info and info.base_dir)
    if problem:
        raise CheckpointMismatchError(f"cannot load the checkpoint: {problem}")
    optimizer = getattr(worker, "optimizer", None)
    loaded = dist_checkpointing.load(_sharded_state(worker, with_optimizer=load_optimizer, is_loading=True),
                                     str(Path(ckpt_dir) / MODEL_SUBDIR))
    keys = ["model"] if len(worker.model) == 1 else [f"model{i}" for i in range(len(worker.model))]
    for chunk, key in zip(worker.model, keys):
        load_chunk_state(chunk, loaded[key])
    if load_optimizer:
        # no_grad: megatron-core 0.16's dp_reshardable loader copies into fp32 master params in place, and with
        # fp32 training those are views of the model's (grad-requiring) parameters
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_step(optimizer, state["optimizer_step"])
        scheduler = getattr(worker, "scheduler", None)
        if scheduler is not None and state["lr_scheduler"] is not None:
            scheduler.load_state_dict(state["lr_scheduler"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # master weights (bf16 training) follow the loaded model
    if load_rng:
        rng = json.loads((Path(ckpt_dir) / RNG_SUBDIR / f"rank{_rank()}.json").read_text())
        coords = [worker.dims.tp_rank, worker.dims.pp_rank, worker.dims.dp_rank]
        if rng["coords"] != coords:
            raise CheckpointMismatchError(f"rank {_rank()}: RNG state was saved by tp/pp/dp rank {rng['coords']}, "
                                          f"this rank is {coords}; pass load_rng=False")
        restore_rng_state(rng["state"])
    _barrier()
    return LoadedCheckpoint(extra_state=state["extra"], optimizer_loaded=load_optimizer, rng_loaded=load_rng,
                            saved_layout=state["layout"])
