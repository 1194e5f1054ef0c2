"""The critic: the actor's trunk with a replicated fp32 hidden->1 value head (megatron GPTModel chunks, DDP),
its optimizer and LR schedule.

- `compute_values`: forward-only values [B, T]; values[:, j] is read at the position before response token j
  (the state the token was generated from), as veRL does, and multiplied by response_mask like veRL.
- `update`: clipped value loss (`core_algos.compute_value_loss`) over epochs x mini-batches x micro-batches,
  normalised over the global mini-batch exactly like the actor (see mppo.workers.actor).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from mppo.config.schema import CriticConfig, ModelConfig
from mppo.core_algos import compute_value_loss, masked_mean
from mppo.models.weights import bucketed, iter_hf_weights
from mppo.parallel import ParallelDims
from mppo.parallel.context_parallel import sum_over_cp
from mppo.workers.base import StepMetrics, as_float64, build_role_model, response_rows, share_of
from mppo.workers.batching import Batch, validate_batch
from mppo.workers.optim import build_lr_scheduler, build_optimizer, ddp_options, wrap_with_ddp
from mppo.workers.pipeline import micro_batches_for, response_forward_step, run_forward_only
from mppo.workers.training import TrainLoop

CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")


def _response_values(output: torch.Tensor, data: Batch) -> torch.Tensor:
    """Value-head output [b, s, 1] (GPTModel returns batch-first outputs) -> fp32 values [b, T] at the positions
    before each response token, 0 where the response is not attended. Under context parallelism each CP rank reads
    its own positions (the CP-local view) and the grids are summed over CP."""
    values = response_rows(output.squeeze(-1).float().t(), data, valid_only=False)
    return sum_over_cp(torch.where(data["response_valid"], values, torch.zeros_like(values)))


def compute_response_values(model_chunks: Sequence[nn.Module], batch: Batch, *, micro_batch_size: int | None,
                            max_token_len: int | None, phase: str = "critic/values") -> torch.Tensor:
    """Forward-only values [B, T] fp32 of a validated batch's response positions (0 where response_mask is 0), on
    every rank (`phase`: its name in TOKEN_COUNTER)."""
    rows = torch.arange(batch["input_ids"].shape[0])
    micro = micro_batches_for(batch, rows, model_chunks, micro_batch_size=micro_batch_size,
                              max_token_len=max_token_len)

    def make_loss_fn(model, data):
        def loss_fn(output):
            values = _response_values(output, data)
            return values.sum(), {"values": values}
        return loss_fn

    with torch.no_grad():
        outs = run_forward_only(model_chunks, micro, response_forward_step(make_loss_fn, hidden_only=False),
                                len(rows), phase=phase)
    return outs["values"] * batch["response_mask"].to(outs["values"].dtype)


class CriticWorker:
    """The trainable value model on this rank's TP/PP/DP shard. All methods are collective over every rank.

    `critic_cfg` must be resolved (mppo.config fills its nulls from the actor's settings); `hf_dir` is
    critic.model.path: an HF causal LM (value head initialised to zero) or a critic export with `score.*`.
    """

    def __init__(self, model_cfg: ModelConfig, critic_cfg: CriticConfig, dims: ParallelDims, hf_dir: str | Path,
                 *, total_steps: int, rollout_n: int = 1):
        self.cfg, self.dims = critic_cfg, dims
        megatron = critic_cfg.megatron
        self.hf_args, chunks, self.dtype = build_role_model(hf_dir, dims, role="critic", model_cfg=model_cfg,
                                                            megatron=megatron)
        use_dist_opt = bool(megatron.use_distributed_optimizer)
        self.model = wrap_with_ddp(chunks, **ddp_options(megatron, dims))
        self.optimizer = build_optimizer(self.model, critic_cfg.optim, use_distributed_optimizer=use_dist_opt,
                                         dtype=self.dtype)
        self.scheduler = build_lr_scheduler(self.optimizer, critic_cfg.optim, total_steps)
        mini = critic_cfg.ppo_mini_batch_size
        self.loop = TrainLoop(self.model, self.optimizer, dims, role="critic",
                              mini_batch_size=mini * rollout_n if mini is not None else None,
                              micro_batch_size=critic_cfg.ppo_micro_batch_size_per_gpu,
                              use_dynamic_bsz=critic_cfg.use_dynamic_bsz,
                              max_token_len=critic_cfg.ppo_max_token_len_per_gpu,
                              epochs=critic_cfg.ppo_epochs, shuffle=False, seed=megatron.seed or 0)

    def compute_values(self, batch: Batch, *, micro_batch_size: int | None = None,
                       max_token_len: int | None = None) -> torch.Tensor:
        """Values [B, T] fp32 of the response positions (0 where response_mask is 0), on every rank."""
        validate_batch(batch)
        batch = self.loop.to_device(batch)
        micro_batch_size, max_token_len = self.loop.micro_batching(micro_batch_size, max_token_len)
        return compute_response_values(self.model, batch, micro_batch_size=micro_batch_size,
                                       max_token_len=max_token_len)

    def update(self, batch: Batch) -> dict[str, float | bool]:
        """Value-loss update on this DP rank's shard (needs `values` and `returns`); global metrics on every
        rank. A mini-batch with a non-finite loss or gradient is not applied (`skipped`). Steps the LR schedule
        once."""
        validate_batch(batch, ["values", "returns"])
        batch = self.loop.to_device(batch)
        return self.loop.update(batch, self.scheduler, metric_keys=CRITIC_METRICS, hidden_only=False,
                                make_loss_fn=lambda model, data, info, metrics: self._loss_fn(data, info, metrics))

    def _loss_fn(self, data, info, metrics: StepMetrics):
        def loss_fn(output: torch.Tensor):
            vpreds = _response_values(output, data)
            mask = data["response_mask"]
            vf_loss, vf_clipfrac = compute_value_loss(vpreds, data["returns"], data["values"], mask,
                                                      self.cfg.cliprange_value, self.cfg.loss_agg_mode,
                                                      **info.as_kwargs())
            token_share = share_of(mask.sum(), info.batch_num_tokens)
            metrics.add("critic/vf_loss", share_of(vf_loss, info.dp_size))
            metrics.add("critic/vf_clipfrac", as_float64(vf_clipfrac) * token_share)
            metrics.add("critic/vpred_mean", as_float64(masked_mean(vpreds.detach(), mask)) * token_share)
            metrics.check_finite(vf_loss)
            return vf_loss, {}
        return loss_fn

    def export_hf_weights(self, bucket_bytes: int, *,
                          dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (HF name, full tensor): the trunk as `model.*` and the head as `score.weight/bias`
        (AutoModelForTokenClassification naming). Collective: every rank must consume all of it."""
        return bucketed(iter_hf_weights(self.model, self.hf_args, dtype=dtype), bucket_bytes)
