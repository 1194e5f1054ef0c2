"""What the actor, critic and reference workers share: building a role's model from the config, the forward
step that reads the model's output at the response positions, and metric reduction over ranks."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.config.schema import MegatronConfig, ModelConfig
from mppo.models.builders import Role, build_gpt_model, unwrap_model
from mppo.models.hf_config import HFModelArgs, read_hf_config
from mppo.models.weights import load_hf_weights
from mppo.parallel import ParallelDims, ParallelLayoutError
from mppo.workers.moe_losses import moe_loss_overrides
from mppo.workers.pipeline import Batch, ForwardStep, LossFn
from mppo.workers.router_replay import replaying, router_replay_overrides

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_dtype(model_cfg: ModelConfig, dims: ParallelDims) -> torch.dtype:
    """Parameter dtype: `model.dtype`, where auto = bf16 on CUDA and fp32 on CPU."""
    if model_cfg.dtype == "auto":
        return torch.bfloat16 if dims.device.type == "cuda" else torch.float32
    if model_cfg.dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be auto, fp32 or bf16, got {model_cfg.dtype!r}")
    return _DTYPES[model_cfg.dtype]


def check_layout(megatron: MegatronConfig, dims: ParallelDims, role: str) -> None:
    """The role's megatron layout must be the one the process groups were built with (None = not set)."""
    wanted = {"tensor_model_parallel_size": (megatron.tensor_model_parallel_size, dims.tp),
              "pipeline_model_parallel_size": (megatron.pipeline_model_parallel_size, dims.pp),
              "virtual_pipeline_model_parallel_size": (megatron.virtual_pipeline_model_parallel_size, dims.vpp),
              "expert_model_parallel_size": (megatron.expert_model_parallel_size, dims.ep)}
    for key, (configured, actual) in wanted.items():
        if key.startswith("virtual") and configured in (None, 1) and actual is None:
            continue
        if configured is not None and configured != actual:
            raise ParallelLayoutError(
                f"{role}.megatron.{key}={configured} but the process groups were built with {actual}; "
                "every role must use the layout passed to mppo.parallel.init_distributed")


def recompute_overrides(recompute: str | None, device: torch.device) -> dict:
    """TransformerConfig keyword arguments for `megatron.recompute` (none | selective | full)."""
    if recompute in (None, "none"):
        return {}
    if recompute in ("selective", "full") and device.type != "cuda":
        raise ValueError(f"megatron.recompute={recompute} needs CUDA: megatron-core's activation checkpointing "
                         "saves and restores CUDA RNG states; use megatron.recompute=none on CPU")
    if recompute == "selective":  # the attention core only (megatron's default selective module)
        return {"recompute_granularity": "selective"}
    if recompute == "full":  # whole layers, one at a time
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise ValueError(f"megatron.recompute must be none, selective or full, got {recompute!r}")


def build_role_model(hf_dir: str | Path, dims: ParallelDims, *, role: Role, model_cfg: ModelConfig,
                     megatron: MegatronConfig,
                     router_replay: str = "disabled") -> tuple[HFModelArgs, list[nn.Module], torch.dtype]:
    """(HF facts, model chunks with the HF weights loaded, dtype) for a role (`router_replay`: the actor's mode)."""
    check_layout(megatron, dims, role)
    args = read_hf_config(hf_dir)
    dtype = resolve_dtype(model_cfg, dims)
    losses = moe_loss_overrides(megatron, is_moe=args.is_moe) if role != "ref" else {}
    chunks = build_gpt_model(args, dims, role=role, dtype=dtype, transformer_impl=model_cfg.transformer_impl,
                             **recompute_overrides(megatron.recompute, dims.device), **losses,
                             **router_replay_overrides(router_replay, is_moe=args.is_moe))
    load_hf_weights(chunks, hf_dir, args)
    return args, chunks, dtype


@contextlib.contextmanager
def _skip_output_layer(model: nn.Module):
    """A last-stage GPTModel returns its final (normed) hidden states [s, b, h] instead of logits:
    GPTModel._postprocess returns the decoder output when post_process is False (the final norm still runs)."""
    core = unwrap_model(model)
    saved = core.post_process
    core.post_process = False
    try:
        yield
    finally:
        core.post_process = saved


def stage_forward(model: nn.Module, input_ids: torch.Tensor, *, hidden_only: bool) -> torch.Tensor:
    """One chunk's forward on a right-padded micro-batch (positions 0..s-1, causal attention)."""
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    with _skip_output_layer(model) if hidden_only else contextlib.nullcontext():
        return model(input_ids, position_ids, None)


def response_rows(output: torch.Tensor, data: Batch, valid_only: bool) -> torch.Tensor:
    """The model output [s, b, ...] at the positions that predict the response tokens.

    valid_only: [N, ...] for the N valid response tokens (row-major); otherwise [b, T, ...].
    """
    index, valid = data["response_index"], data["response_valid"]
    rows = torch.arange(index.shape[0], device=index.device)[:, None].expand_as(index)
    if valid_only:
        return output[index[valid], rows[valid]]
    return output[index, rows]


def response_forward_step(make_loss_fn: Callable[[nn.Module, Batch], LossFn], *, hidden_only: bool) -> ForwardStep:
    """A run_pipeline forward step: every stage runs its chunk; the last stage hands its output to the
    `make_loss_fn(model, micro_batch)` closure (which reads the response positions with `response_rows`)."""

    def forward_step(model: nn.Module, batch: Batch):
        last = unwrap_model(model).post_process
        with replaying(model, batch):  # the rollout's MoE routes, for an actor built to replay them
            output = stage_forward(model, batch["input_ids"], hidden_only=hidden_only and last)
        return output, (make_loss_fn(model, batch) if last else None)

    return forward_step


def output_weight(model: nn.Module) -> torch.Tensor:
    """This TP rank's shard of the output (LM head) weight of a last-stage chunk."""
    core = unwrap_model(model)
    if core.share_embeddings_and_output_weights:
        return core.shared_embedding_or_output_weight()
    return core.output_layer.weight


class StepMetrics:
    """Per-optimizer-step metric sums over micro-batches, reduced over all ranks in one collective.

    A worker adds each micro-batch's *contribution* to the global value (e.g. loss / dp, or a token-weighted
    fraction); summing them over micro-batches and DP ranks gives the global mini-batch value. Only the last
    pipeline stage's first TP rank contributes (the others hold copies). A non-finite loss flag rides along.
    """

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.sums = torch.zeros(len(self.keys), dtype=torch.float64)
        self.present = torch.zeros(len(self.keys), dtype=torch.float64)
        self.loss_nonfinite = 0.0

    def add(self, key: str, contribution: float) -> None:
        i = self.keys.index(key)
        self.sums[i] += contribution
        self.present[i] += 1

    def reduce(self, *, contributes: bool, device: torch.device) -> tuple[dict[str, float], bool]:
        """(global metrics that some rank reported, whether any loss was not finite) on every rank (collective
        over the world)."""
        n = len(self.keys)
        vec = torch.zeros(2 * n + 1, dtype=torch.float64)
        if contributes:
            vec[:n], vec[n:2 * n], vec[2 * n] = self.sums, self.present, self.loss_nonfinite
        vec = vec.to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
        vec = vec.cpu()
        metrics = {k: float(vec[i]) for i, k in enumerate(self.keys) if vec[n + i] > 0}
        return metrics, bool(vec[2 * n] > 0)


def mean_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over the optimizer steps that report it."""
    keys = {k for s in steps for k in s}
    return {k: sum(s[k] for s in steps if k in s) / sum(1 for s in steps if k in s) for k in sorted(keys)}
