"""The actor: the policy as megatron-core GPTModel chunks (DDP-wrapped), its optimizer and LR schedule.

- `compute_log_prob` / `compute_log_prob_outputs`: forward-only per-token log-probs (and entropy) of the
  response tokens.
- `update`: `ppo_epochs` x mini-batches x micro-batches of PPO through the pipeline schedule, one optimizer
  step per mini-batch. On-policy (one epoch, one mini-batch), the old log-probs can come from the update's own
  forward, detached, instead of a separate `compute_log_prob` pass (veRL's and TRL's on-policy shortcut).
  loss = pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss (use_kl_loss), each aggregated with
  `actor.loss_agg_mode` over the GLOBAL mini-batch (`GlobalBatchInfo`: DP size, valid tokens and non-empty
  sequences summed over DP). A micro-batch loss is then its share of the global loss times dp;
  run_pipeline undoes the schedule's division by the number of micro-batches and DDP averages over DP, so the
  gradient is that of the global mini-batch loss however the batch is split.
  The loss runs through the fused gradient-in-forward kernel where it covers the config, else log-probs then
  core_algos (mppo.workers.loss_selection says which and why; logged once).
- `export_hf_weights`: HF-named full tensors in buckets (rollout weight sync and HF checkpoints).

Policy losses that pick tokens inside what they are given (clip_cov, kl_cov) pick them per micro-batch, as
veRL does; geo_mean's row mean is rescaled to the global mini-batch (ROW_MEAN_LOSSES).

Metrics are global, so they do not depend on how the batch is split: loss terms are the global mini-batch values;
`pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower` are token-weighted over the mini-batch (the global masked mean,
where veRL averages per-micro-batch means); all are averaged over the optimizer steps of the update.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch

from mppo.config.schema import ActorConfig, ModelConfig
from mppo.core_algos import (PolicyLossParams, RolloutCorrectionParams, agg_loss, compute_policy_loss_bypass_mode,
                              get_policy_loss_fn, kl_penalty)
from mppo.models.weights import bucketed, iter_hf_weights
from mppo.parallel import ParallelDims
from mppo.workers.base import StepMetrics, as_float64, build_role_model, share_of
from mppo.workers.batching import Batch, validate_batch
from mppo.workers.logprob import compute_response_outputs, make_logprob_fn, response_logprobs
from mppo.workers.loss_selection import fused_actor_loss, select_loss_path
from mppo.workers.optim import build_lr_scheduler, build_optimizer, ddp_options, wrap_with_ddp
from mppo.workers.pipeline import broadcast_from_last_stage
from mppo.workers.training import TrainLoop

# Policy losses that average over ALL rows of what they are given and ignore GlobalBatchInfo (veRL quirk):
# their micro-batch row mean is rescaled to its share of the global mini-batch's row mean.
ROW_MEAN_LOSSES = ("geo_mean",)
log = logging.getLogger("mppo")
ACTOR_METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                 "actor/pg_clipfrac_lower")


def policy_loss_params(cfg: ActorConfig) -> PolicyLossParams:
    """The policy-loss knobs of an ActorConfig."""
    pl = cfg.policy_loss
    return PolicyLossParams(
        clip_ratio=cfg.clip_ratio, clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg, clip_cov_ratio=pl.clip_cov_ratio,
        clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub, kl_cov_ratio=pl.kl_cov_ratio,
        ppo_kl_coef=pl.ppo_kl_coef, dro_beta=pl.dro_beta)


class ForwardLogProbs:
    """Each row's log-probs from its first forward in an update (detached, batch row order), collected from the
    last pipeline stage's micro-batch outputs: the old log-probs of an on-policy update."""

    def __init__(self, response_mask: torch.Tensor):
        self.values = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
        self.seen = torch.zeros(response_mask.shape[0], dtype=torch.bool, device=response_mask.device)

    def add(self, rows: list[torch.Tensor], outputs: list[dict[str, torch.Tensor]]) -> None:
        """Record one optimizer step's micro-batches (`outputs` is empty on stages other than the last)."""
        for row_ids, out in zip(rows, outputs):
            row_ids = row_ids.to(self.values.device)
            fresh = ~self.seen[row_ids]
            self.values[row_ids[fresh]] = out["log_probs"][:len(row_ids)][fresh].float()
            self.seen[row_ids] = True

    def on_every_stage(self, dims: ParallelDims) -> torch.Tensor:
        """The collected values on every rank (a collective over the pipeline group when PP > 1)."""
        if dims.pp == 1:
            return self.values
        return broadcast_from_last_stage([{"log_probs": self.values}])[0]["log_probs"].to(dims.device)


class ActorWorker:
    """The trainable policy on this rank's TP/PP/DP shard. All methods are collective over every rank."""

    def __init__(self, model_cfg: ModelConfig, actor_cfg: ActorConfig, dims: ParallelDims, hf_dir: str | Path, *,
                 total_steps: int, rollout_n: int = 1, rollout_correction: RolloutCorrectionParams | None = None):
        """`rollout_correction` with bypass_mode: the update's loss is rollout correction's bypass loss (the batch's
        old_log_probs are then the engine's); otherwise it is not used here (the trainer applies it)."""
        self.cfg, self.dims = actor_cfg, dims
        self.policy_loss_fn = get_policy_loss_fn(actor_cfg.policy_loss.loss_mode)
        self.policy_params = policy_loss_params(actor_cfg)
        self.bypass = rollout_correction is not None and rollout_correction.bypass_mode
        if self.bypass:
            self.policy_loss_fn = compute_policy_loss_bypass_mode
            self.policy_params = replace(self.policy_params, rollout_correction=rollout_correction)
        self.logprob_fn = make_logprob_fn(actor_cfg.logprob_impl, actor_cfg.kernel_backend)
        self.loss_path = select_loss_path(actor_cfg, rollout_correction_bypass=self.bypass)
        if dims.rank == 0:
            log.info("actor loss: %s", self.loss_path.describe())
        self.hf_args, chunks, self.dtype = build_role_model(hf_dir, dims, role="actor", model_cfg=model_cfg,
                                                            megatron=actor_cfg.megatron,
                                                            router_replay=actor_cfg.router_replay.mode,
                                                            lora_seed=actor_cfg.megatron.seed or 0)
        use_dist_opt = bool(actor_cfg.megatron.use_distributed_optimizer)
        self.model = wrap_with_ddp(chunks, **ddp_options(actor_cfg.megatron, dims))
        self.optimizer = build_optimizer(self.model, actor_cfg.optim, use_distributed_optimizer=use_dist_opt,
                                         dtype=self.dtype)
        self.scheduler = build_lr_scheduler(self.optimizer, actor_cfg.optim, total_steps)
        self.loop = TrainLoop(self.model, self.optimizer, dims, role="actor",
                              mini_batch_size=actor_cfg.ppo_mini_batch_size * rollout_n,
                              micro_batch_size=actor_cfg.ppo_micro_batch_size_per_gpu,
                              use_dynamic_bsz=actor_cfg.use_dynamic_bsz,
                              max_token_len=actor_cfg.ppo_max_token_len_per_gpu,
                              epochs=actor_cfg.ppo_epochs, shuffle=actor_cfg.shuffle,
                              seed=actor_cfg.megatron.seed or 0)
        # after an update that took the old log-probs from its forward, or in bypass mode: each row's log-probs
        # [B, T] from its first forward in the update; else None
        self.forward_log_probs: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------ inference
    def compute_log_prob(self, batch: Batch, *, temperature: float, micro_batch_size: int | None = None,
                         max_token_len: int | None = None) -> torch.Tensor:
        """Log-probs [B, T] fp32 of the response tokens on every rank (0 where the response is padding), as
        ReferenceWorker.compute_log_prob returns them; `compute_log_prob_outputs` adds entropy. Micro-batches by
        count or token budget (default: the actor's update settings)."""
        return self.compute_log_prob_outputs(batch, temperature=temperature, micro_batch_size=micro_batch_size,
                                             max_token_len=max_token_len)["log_probs"]

    def compute_log_prob_outputs(self, batch: Batch, *, temperature: float, micro_batch_size: int | None = None,
                                 max_token_len: int | None = None, calculate_entropy: bool = False,
                                 calculate_sum_pi_squared: bool = False) -> dict[str, torch.Tensor]:
        """{"log_probs"[, "entropy"][, "sum_pi_squared"]} [B, T] fp32 of the response tokens, on every rank
        (sum_pi_squared: sum over the vocabulary of p^2, for the optimal-token-baseline estimators)."""
        validate_batch(batch)
        batch = self.loop.to_device(batch)
        micro_batch_size, max_token_len = self.loop.micro_batching(micro_batch_size, max_token_len)
        with torch.no_grad():
            return compute_response_outputs(self.model, batch, self.logprob_fn, vocab_size=self.hf_args.vocab_size,
                                            temperature=temperature, micro_batch_size=micro_batch_size,
                                            max_token_len=max_token_len, calculate_entropy=calculate_entropy,
                                            calculate_sum_pi_squared=calculate_sum_pi_squared,
                                            phase="actor/log_prob")

    # ------------------------------------------------------------------------------------------ training
    def update(self, batch: Batch, *, temperature: float,
               old_log_prob_from_update: bool = False) -> dict[str, float | bool]:
        """PPO update on this DP rank's shard of the step's batch; returns global metrics (same on every rank).

        Needs advantages, old_log_probs (unless `old_log_prob_from_update`) and ref_log_prob (with use_kl_loss).
        `old_log_prob_from_update`: the update is on-policy (one epoch, one mini-batch: every row passes once
        through the forward, with the weights that generated it), so the old log-probs ARE this forward's
        log-probs; they are taken from it, detached (ratio exactly 1), instead of from a separate forward pass,
        and kept in `self.forward_log_probs` [B, T] on every rank afterwards (for the rollout-vs-actor metrics;
        in bypass mode too, where they are pi_theta at each row's first forward).
        A mini-batch whose loss or gradients are not finite is not applied (`skipped` is then True). Steps the
        LR schedule once.
        """
        required = ["advantages"] + ([] if old_log_prob_from_update else ["old_log_probs"])
        required += ["ref_log_prob"] if self.cfg.use_kl_loss else []
        rows, _ = validate_batch(batch, required)
        if old_log_prob_from_update:
            self._check_on_policy(rows)
        batch = self.loop.to_device(batch)
        if old_log_prob_from_update:
            batch.pop("old_log_probs", None)  # one source of old log-probs: this update's forward
        record = old_log_prob_from_update or self.bypass
        forward = ForwardLogProbs(batch["response_mask"]) if record else None
        out = self.loop.update(
            batch, self.scheduler, metric_keys=ACTOR_METRICS, hidden_only=True,
            make_loss_fn=lambda model, data, info, metrics: self._loss_fn(model, data, temperature, info, metrics,
                                                                          record),
            on_step=(lambda mini, result: forward.add(mini.rows, result.outputs)) if forward is not None else None)
        self.forward_log_probs = forward.on_every_stage(self.dims) if forward is not None else None
        return out

    def _check_on_policy(self, rows: int) -> None:
        """Old log-probs from the update's forward are exact only if that forward is the first and only one
        over each row (then the weights are those that generated the rollout)."""
        loop = self.loop
        if loop.epochs != 1 or rows != loop.local_mini_batch_size:
            raise ValueError(
                f"actor update with old log-probs from its own forward needs one epoch over one mini-batch, but "
                f"ppo_epochs={loop.epochs} and this rank's {rows} rows form {rows // loop.local_mini_batch_size} "
                f"mini-batch(es) of {loop.local_mini_batch_size}: later forwards see updated weights. Compute "
                "old_log_probs before the update (actor.reuse_on_policy_log_prob=false does so in the trainer)")

    def _loss_fn(self, model, data, temperature, info, metrics: StepMetrics, record_log_probs: bool = False):
        cfg, dp = self.cfg, info.dp_size

        def loss_fn(hidden: torch.Tensor):
            if self.loss_path.fused:  # the gradient-in-forward kernel (mppo.workers.loss_selection)
                loss, contributions, log_prob = fused_actor_loss(
                    model, hidden, data, cfg, info, params=self.policy_params, temperature=temperature,
                    vocab_size=self.hf_args.vocab_size)
                for key, value in contributions.items():
                    metrics.add(key, value)
                metrics.check_finite(loss)
                return loss, ({"log_probs": log_prob} if record_log_probs else {})
            log_prob, entropy = response_logprobs(model, hidden, data, self.logprob_fn, temperature=temperature,
                                                  vocab_size=self.hf_args.vocab_size, compute_entropy=True)
            mask = data["response_mask"]
            # on-policy: this forward is the first with the rollout's weights, so it is the old policy too
            old_log_prob = data["old_log_probs"] if "old_log_probs" in data else log_prob.detach()
            pg_loss, pg_metrics = self.policy_loss_fn(
                old_log_prob, log_prob, data["advantages"], mask, cfg.loss_agg_mode,
                config=self.policy_params, rollout_is_weights=data.get("rollout_is_weights"), batch_info=info)
            if cfg.policy_loss.loss_mode in ROW_MEAN_LOSSES:
                # (rows here / global rows) x dp, with global rows = local mini-batch rows x dp
                pg_loss = pg_loss * (mask.shape[0] / self.loop.local_mini_batch_size)
            entropy_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **info.as_kwargs())
            loss = pg_loss
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * entropy_loss
            if cfg.use_kl_loss:
                kld = kl_penalty(log_prob, data["ref_log_prob"], cfg.kl_loss_type)
                kl_loss = agg_loss(kld, mask, cfg.loss_agg_mode, **info.as_kwargs())
                loss = loss + cfg.kl_loss_coef * kl_loss
                metrics.add("actor/kl_loss", share_of(kl_loss, dp))
            # each micro-batch loss is (its share of the global value) x dp: / dp sums to the global value
            metrics.add("actor/pg_loss", share_of(pg_loss, dp))
            metrics.add("actor/entropy", share_of(entropy_loss, dp))
            token_share = share_of(mask.sum(), info.batch_num_tokens)
            for key, value in pg_metrics.items():
                if key in ACTOR_METRICS:
                    metrics.add(key, as_float64(value) * token_share)
            metrics.check_finite(loss)
            return loss, ({"log_probs": log_prob.detach()} if record_log_probs else {})

        return loss_fn

    # ------------------------------------------------------------------------------------------ weights
    def export_hf_weights(self, bucket_bytes: int, *,
                          dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of (HF name, full tensor) on every rank (collective: every rank must consume all of it)."""
        return bucketed(iter_hf_weights(self.model, self.hf_args, dtype=dtype), bucket_bytes)
