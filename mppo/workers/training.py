"""The loop the actor and critic updates share: epochs x mini-batches x micro-batches, one optimizer step per
mini-batch, with the global batch facts of each mini-batch and a NaN/inf guard that skips the step.

A role's update is `TrainLoop.update(batch, scheduler, make_loss_fn=..., metric_keys=...)`: the role supplies
only its loss (a `MakeLossFn`); the loop owns the mini-batches, the skip handling, grad norm, LR and the
scheduler step, and returns the role's metrics under its prefix (`actor/...`, `critic/...`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.core_algos import GlobalBatchInfo
from mppo.parallel import ParallelDims
from mppo.workers.base import StepMetrics, mean_metrics
from mppo.workers.batching import Batch, BatchError, global_batch_info, mini_batch_rows
from mppo.workers.moe_losses import MoELossMeter
from mppo.workers.optim import current_lr, finish_param_sync, forward_backward, optimizer_step
from mppo.workers.pipeline import ForwardStep, LossFn, micro_batches_for, pipeline_inputs, response_forward_step

# (model chunk, micro-batch, the mini-batch's global facts, the step's metrics) -> the last stage's loss_fn, which
# adds the micro-batch's metric contributions to the StepMetrics
MakeLossFn = Callable[[nn.Module, Batch, GlobalBatchInfo, StepMetrics], LossFn]


@dataclass
class StepResult:
    metrics: dict[str, float]  # global values of this optimizer step
    grad_norm: float  # before clipping; NaN when skipped
    skipped: bool
    # the last PP stage's per-micro-batch loss outputs (detached; padded rows included); empty elsewhere
    outputs: list[dict[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class MiniBatch:
    """One optimizer step's input: pipeline inputs of each micro-batch, the rows of this rank's batch that each
    micro-batch holds (in order), and the global batch facts."""

    micro_batches: list[Batch]
    rows: list[torch.Tensor]
    info: GlobalBatchInfo


class TrainLoop:
    """Mini/micro-batching and optimizer steps of one trainable role (all methods collective)."""

    def __init__(self, model: Sequence[nn.Module], optimizer, dims: ParallelDims, *, role: str,
                 mini_batch_size: int, micro_batch_size: int | None, use_dynamic_bsz: bool, max_token_len: int,
                 epochs: int, shuffle: bool, seed: int):
        """`mini_batch_size` is in samples over all DP ranks (ppo_mini_batch_size x rollout.n); the sizes come from
        a resolved, validated config (mppo.config: a mini-batch splits over DP into whole micro-batches)."""
        self.model, self.optimizer, self.dims, self.role = list(model), optimizer, dims, role
        self.local_mini_batch_size = mini_batch_size // dims.dp
        self.micro_batch_size, self.use_dynamic_bsz = micro_batch_size, use_dynamic_bsz
        self.max_token_len = max_token_len
        self.epochs, self.shuffle, self.seed = epochs, shuffle, seed

    def to_device(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The batch's tensors on this rank's device (non-tensor entries such as uids are not needed here)."""
        return {k: v.to(self.dims.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}

    def micro_batching(self, micro_batch_size: int | None, max_token_len: int | None) -> tuple[int | None, int | None]:
        """Explicit micro-batching (one of the two), else the role's update setting."""
        if micro_batch_size is not None and max_token_len is not None:
            raise ValueError("give micro_batch_size (by count) or max_token_len (token budget), not both")
        if micro_batch_size is None and max_token_len is None:
            if self.use_dynamic_bsz:
                return None, self.max_token_len
            return self.micro_batch_size, None
        return micro_batch_size, max_token_len

    def _check_same_batch_size(self, rows: int) -> None:
        """Every DP rank must hold the same number of rows, or the ranks would run different step counts."""
        if self.dims.dp == 1:
            return
        from megatron.core import parallel_state as ps

        sizes = torch.tensor([rows, -rows], dtype=torch.int64, device=self.dims.device)
        dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        if int(sizes[0]) != -int(sizes[1]):
            raise BatchError(f"{self.role}: DP ranks hold between {-int(sizes[1])} and {int(sizes[0])} rows; "
                             "give every DP rank an equal shard of the batch")

    def mini_batches(self, batch: Batch, update_index: int) -> Iterator[MiniBatch]:
        """The mini-batches of this rank's batch, `epochs` times over.

        Shuffling (when on) is seeded by (seed, update_index, epoch): the same on every TP/PP rank of a replica
        and reproducible after a resume.
        """
        from megatron.core import parallel_state as ps

        rows = batch["input_ids"].shape[0]
        self._check_same_batch_size(rows)
        for epoch in range(self.epochs):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + update_index * 1_009 + epoch)
            for mini_rows in mini_batch_rows(rows, self.local_mini_batch_size, shuffle=self.shuffle,
                                             generator=generator):
                info = global_batch_info(batch["response_mask"][mini_rows.to(self.dims.device)],
                                         dp_group=ps.get_data_parallel_group(), dp_size=self.dims.dp)
                micro = micro_batches_for(batch, mini_rows, self.model, micro_batch_size=self.micro_batch_size
                                          if not self.use_dynamic_bsz else None,
                                          max_token_len=self.max_token_len if self.use_dynamic_bsz else None)
                yield MiniBatch(pipeline_inputs(self.model, micro, phase=f"{self.role}/update"),
                                [mb.rows for mb in micro], info)

    def step(self, micro_batches: Sequence[Batch], forward_step: ForwardStep, metrics: StepMetrics,
             info: GlobalBatchInfo) -> StepResult:
        """Forward-backward over the micro-batches, then the optimizer step unless a loss on any rank or the
        global gradient norm is not finite (or the mini-batch has no valid token)."""
        if not info.batch_num_tokens:  # every rank sees the same all-reduced count
            return StepResult({}, math.nan, True)
        outputs = forward_backward(self.model, self.optimizer, micro_batches, forward_step)
        # one rank per replica: TP and CP ranks hold copies (per-token outputs are summed over CP before the loss)
        contributes = self.dims.is_last_stage and self.dims.tp_rank == 0 and self.dims.cp_rank == 0
        values, loss_nonfinite = metrics.reduce(contributes=contributes, device=self.dims.device)
        if loss_nonfinite:
            return StepResult(values, math.nan, True, outputs)
        applied, grad_norm = optimizer_step(self.optimizer)
        return StepResult(values, grad_norm if applied else math.nan, not applied, outputs)

    def update(self, batch: Batch, scheduler, *, make_loss_fn: MakeLossFn, metric_keys: Sequence[str],
               hidden_only: bool, on_step: Callable[[MiniBatch, StepResult], None] | None = None
               ) -> dict[str, float | bool]:
        """One update of the role over a device batch: every mini-batch's forward-backward and optimizer step,
        then one LR schedule step. Returns the global metrics (the same on every rank): the mean over optimizer
        steps of `metric_keys`, and `{role}/grad_norm` (mean over applied steps), `{role}/lr` (the LR the steps
        used), `{role}/skipped_optimizer_steps` and `skipped` (a mini-batch whose loss or gradients were not
        finite was not applied), and `{role}/moe_aux_loss`, `{role}/moe_z_loss` for a MoE model with those losses
        on (mppo.workers.moe_losses; read once per update). `hidden_only`: the last stage hands its final hidden
        states to the loss instead of its output layer's; `on_step(mini_batch, result)` sees each step (e.g. to
        collect its outputs)."""
        lr = current_lr(self.optimizer)
        steps, grad_norms, skipped = [], [], 0
        moe_losses = MoELossMeter.start(self.model, self.role)
        for mini in self.mini_batches(batch, scheduler.num_steps):
            metrics, info = StepMetrics(metric_keys), mini.info
            step = response_forward_step(lambda model, data: make_loss_fn(model, data, info, metrics),
                                         hidden_only=hidden_only)
            result = self.step(mini.micro_batches, step, metrics, info)
            if on_step is not None:
                on_step(mini, result)
            steps.append(result.metrics)
            if result.skipped:
                skipped += 1
            else:
                grad_norms.append(result.grad_norm)
        # the last step's parameter all-gather, which overlap_param_gather leaves to the next forward: what reads
        # the weights next (the rollout's weight sync, a checkpoint, the offload) reads them outside a forward
        finish_param_sync(self.model)
        scheduler.step(1)
        out: dict[str, float | bool] = dict(mean_metrics(steps))
        out[f"{self.role}/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else math.nan
        out[f"{self.role}/lr"] = lr
        out[f"{self.role}/skipped_optimizer_steps"] = skipped
        out.update(moe_losses.finish())  # {role}/moe_aux_loss, {role}/moe_z_loss when the model has them on
        out["skipped"] = skipped > 0
        return out
