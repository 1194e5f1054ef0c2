"""Training machinery around megatron-core: DDP for DP gradient reduction, the optimizer, the LR schedule and
one forward-backward-step over micro-batches.

- `wrap_with_ddp`: megatron `DistributedDataParallel` per model chunk (grads accumulate in fp32 buffers and are
  averaged over DP once per step, in `finalize_model_grads`, which the pipeline schedule calls; with
  `megatron.overlap_grad_reduce` / `overlap_param_gather` bucket by bucket, overlapped with the backward / the
  next forward).
- `build_optimizer`: `get_megatron_optimizer` (Adam with decoupled weight decay, optional distributed optimizer,
  grad clipping). bf16 training is megatron's mixed precision: every model parameter is bf16 (forward and
  backward run in bf16; the builder casts the norms too, so there is one grad buffer, which the distributed
  optimizer's checkpoint needs), gradients accumulate and reduce in fp32 (`grad_reduce_in_fp32`), and the
  optimizer keeps fp32 main params and Adam moments (`OptimizerConfig.bf16`), steps those, and copies them back
  rounded to bf16; checkpoints carry the fp32 main params, so a resume is bit-identical. Log-probs, entropies and
  losses are computed in fp32 from the bf16 hidden states (mppo.kernels, logprob.vocab_parallel_logprob_entropy).
- `build_lr_scheduler`: megatron's `OptimizerParamScheduler` (linear warm-up from 0, then constant or cosine
  decay to `min_lr_ratio * lr`); state_dict'able. The workers step it once per `update()` call (one PPO step),
  as veRL does, so `total_steps` is the trainer's number of PPO steps.
- `forward_backward` / `optimizer_step`: one optimizer step, skipped when the gradient norm is not finite (the
  caller also skips on a non-finite loss, from a flag all ranks agree on).
"""
from __future__ import annotations

import math
import weakref
from typing import Sequence

import torch
from torch import nn

from mppo.config.decisions import uses_overlap_grad_reduce, uses_overlap_param_gather
from mppo.config.schema import MegatronConfig, OptimConfig
from mppo.parallel import ParallelDims
from mppo.workers.pipeline import Batch, ForwardStep, run_pipeline


def ddp_options(megatron: MegatronConfig, dims: ParallelDims) -> dict[str, bool]:
    """wrap_with_ddp's keyword arguments for a role's `megatron` section (the overlap keys' null rules are
    mppo.config.decisions')."""
    return {"use_distributed_optimizer": bool(megatron.use_distributed_optimizer),
            "overlap_grad_reduce": uses_overlap_grad_reduce(megatron, dims.backend),
            "overlap_param_gather": uses_overlap_param_gather(megatron, dims.backend)}


# Parameters per DDP bucket with overlap on; None: megatron's default (max(4e7, 1e6 x DP)). Tests lower it to give a
# tiny model several buckets.
BUCKET_SIZE: int | None = None


def wrap_with_ddp(chunks: Sequence[nn.Module], *, use_distributed_optimizer: bool, overlap_grad_reduce: bool = False,
                  overlap_param_gather: bool = False) -> list[nn.Module]:
    """Wrap each model chunk in megatron's DistributedDataParallel and hand megatron's pipeline schedules the
    hooks that overlap run on (as Megatron-LM's training loop does).

    Without overlap, the gradients are all-reduced (reduce-scattered with the distributed optimizer) in one call
    per step after the last micro-batch, and the distributed optimizer all-gathers the updated parameters right
    after its step. `overlap_grad_reduce`: each bucket's reduction starts, asynchronously, as soon as the last
    micro-batch's backward has produced all of its gradients (`no_sync_func` keeps the earlier micro-batches from
    starting it; `grad_sync_func` lets the schedule start a chunk's at megatron's chosen point), and
    finalize_model_grads waits for them. `overlap_param_gather` (distributed optimizer only): the step leaves the
    all-gather to the next forward, whose pre-hooks start each bucket's and wait for it just before its first
    module runs (with interleaved pipelines the schedule starts each chunk's, `param_sync_func`); call
    `finish_param_sync` before reading the parameters outside a forward.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    interleaved = len(chunks) > 1
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,  # bf16 params: accumulate and reduce gradients in fp32
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        # Megatron-LM aligns the chunks' param all-gathers across PP stages with the interleaved schedule only
        align_param_gather=overlap_param_gather and interleaved,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,  # NaN/inf skips the step instead of raising (see optimizer_step)
        bucket_size=BUCKET_SIZE,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        # Only the first chunk buckets its grads; megatron-LM does the same with virtual pipelines.
        wrapped.append(DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0))
    config = wrapped[0].config  # the one TransformerConfig of every chunk, which the schedules read

    def per_chunk(method: str):
        funcs = [getattr(chunk, method) for chunk in wrapped]
        return funcs if interleaved else funcs[0]

    config.no_sync_func = per_chunk("no_sync") if overlap_grad_reduce else None
    config.grad_sync_func = per_chunk("start_grad_sync") if overlap_grad_reduce else None
    config.param_sync_func = per_chunk("start_param_sync") if ddp_config.align_param_gather else None
    return wrapped


def finish_param_sync(ddp_chunks: Sequence[nn.Module]) -> None:
    """Complete the parameter all-gather that overlap_param_gather defers to the next forward, so that the
    parameters are the updated ones outside a forward too (weight export, checkpoints, offload); the next forward
    then has nothing left to gather. A no-op without overlap_param_gather."""
    for chunk in ddp_chunks:
        if getattr(chunk, "use_forward_hook", False):
            chunk.start_param_sync(force_sync=True)


def build_optimizer(ddp_chunks: Sequence[nn.Module], optim: OptimConfig, *, use_distributed_optimizer: bool,
                    dtype: torch.dtype):
    """megatron-core's Adam optimizer over the DDP-wrapped chunks; wires the loss-scale and grad-finalize hooks
    into the chunks' TransformerConfig so the pipeline schedule reduces gradients over DP."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        weight_decay=optim.weight_decay,
        adam_beta1=float(optim.betas[0]),
        adam_beta2=float(optim.betas[1]),
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        # bf16: Float16OptimizerWithFloat16Params / DistributedOptimizer with fp32 main params. (Lower-precision
        # main params or moments, use_precision_aware_optimizer, need Transformer Engine's FusedAdam.)
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, list(ddp_chunks))
    model_config = ddp_chunks[0].config
    # Weakly: megatron's fp32 distributed optimizer keeps views of the parameters (their autograd nodes hold DDP's
    # backward hooks, which hold DDP and so this config), a cycle through C++ that Python's collector cannot break:
    # a bound method here would keep every model and its process groups (with their threads) alive for good.
    scale_loss = weakref.WeakMethod(optimizer.scale_loss)
    model_config.grad_scale_func = lambda loss: scale_loss()(loss)
    model_config.finalize_model_grads_func = finalize_model_grads
    return optimizer


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """`lr_warmup_steps`, or `lr_warmup_steps_ratio * total_steps` when it is negative (veRL's rule)."""
    if optim.lr_warmup_steps >= 0:
        return optim.lr_warmup_steps
    return int(optim.lr_warmup_steps_ratio * total_steps)


def build_lr_scheduler(optimizer, optim: OptimConfig, total_steps: int):
    """megatron's OptimizerParamScheduler: linear warm-up from 0 over `warmup_steps`, then `lr` (constant) or a
    cosine decay to `lr * min_lr_ratio` at `total_steps`. Weight decay stays constant."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1 (the trainer's number of PPO steps), got {total_steps}")
    warmup = warmup_steps(optim, total_steps)
    if warmup >= total_steps and optim.lr_scheduler == "cosine":
        raise ValueError(f"{warmup} warm-up steps leave no room for a cosine decay over {total_steps} steps; "
                         "lower lr_warmup_steps(_ratio) or raise total_steps")
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=optim.lr, min_lr=optim.lr * optim.min_lr_ratio,
        lr_warmup_steps=warmup,
        # megatron asserts warm-up < decay steps even for a constant schedule, where decay steps are unused
        lr_decay_steps=max(total_steps, warmup + 1), lr_decay_style=optim.lr_scheduler,
        start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True)


def current_lr(optimizer) -> float:
    """The learning rate the next optimizer step uses."""
    return float(optimizer.param_groups[0]["lr"])


def forward_backward(ddp_chunks: Sequence[nn.Module], optimizer, micro_batches: Sequence[Batch],
                     forward_step: ForwardStep) -> list[dict[str, torch.Tensor]]:
    """Zero the gradients, run every micro-batch forward and backward through the pipeline schedule and reduce
    the gradients over DP. Returns the last stage's per-micro-batch outputs (empty on other stages).

    The gradient is that of the SUM of the micro-batch losses, averaged over DP ranks by DDP: normalise each
    loss with the global batch facts (`agg_loss` with `GlobalBatchInfo`) to get the global-batch gradient.
    """
    for chunk in ddp_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    return run_pipeline(ddp_chunks, micro_batches, forward_step, forward_only=False, broadcast_outputs=False)


def optimizer_step(optimizer) -> tuple[bool, float]:
    """Clip and apply the gradients unless their global norm is not finite; return (applied, norm before clipping).

    The norm is reduced over every rank holding a piece of the model, so all ranks agree on skipping.
    megatron's own overflow check covers fp16 loss scaling only, not bf16/fp32, hence the check here.
    """
    optimizer.prepare_grads()  # main grads -> the optimizer's grads (idempotent without fp16 loss scaling)
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return False, grad_norm
    applied, _, _ = optimizer.step()
    return bool(applied), grad_norm
