"""What the trainer does with the rollout engine's own log-probs (`rollout_log_probs`) each step, in veRL 0.9.1's
order (ray_trainer / trainer_base), always on the GLOBAL batch (gathered over DP) so that no value depends on the
DP split:

1. Old log-probs: from the old-log-prob pass; from the on-policy update's own forward
   (`actor.reuse_on_policy_log_prob`); or, in bypass mode (`algorithm.rollout_correction.bypass_mode`), the
   engine's log-probs themselves (no pass).
2. `mismatch_metrics` as soon as the actor's log-probs for the rollout's weights are known:
   `training/rollout_probs_diff_*` and `training/rollout_actor_probs_pearson_corr` (after the pass, or after an
   on-policy update, bypass mode included).
3. Decoupled mode, after the KL penalty and before the advantages (`RolloutCorrector.before_advantages`): IS
   weights into `rollout_is_weights` (the policy loss multiplies its per-token loss by them) and the rejection into
   `response_mask` (advantages, critic and actor then ignore rejected tokens; the KL penalty already used the
   unrejected mask, as in veRL), with the `rollout_corr/...` metrics. When IS and rejection are off only the
   metrics are computed, and with old-log-prob reuse they come after the update, from its forward
   (`after_update`): the same values, since the update is on-policy.
4. Bypass mode: the actor's loss computes weights and rejection per micro-batch from its current log-probs
   (`core_algos.compute_policy_loss_bypass_mode`); `after_update` reports the `rollout_corr/...` metrics of each
   row's first forward in the update, over the global batch.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from mppo.config.decisions import OldLogProbSource, off_policy_update
from mppo.config.schema import MppoConfig, RolloutCorrectionConfig
from mppo.core_algos import RolloutCorrectionParams, compute_rollout_correction_and_rejection_mask
from mppo.trainer.metrics import rollout_mismatch_metrics
from mppo.trainer.rollout_batch import all_gather_rows
from mppo.workers.batch_schema import UNREJECTED_MASK

log = logging.getLogger("mppo")


def correction_params(cfg: RolloutCorrectionConfig) -> RolloutCorrectionParams:
    """algorithm.rollout_correction as core_algos takes it."""
    return RolloutCorrectionParams(
        rollout_is=cfg.rollout_is, rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize, rollout_rs=cfg.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold, bypass_mode=cfg.bypass_mode, loss_type=cfg.loss_type)


def gather_global(batch: dict[str, torch.Tensor], keys: tuple[str, ...],
                  dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The global batch's `keys` (this rank's rows concatenated over DP in rank order), on the CPU."""
    return {k: all_gather_rows(batch[k].detach().cpu(), dp_group) for k in keys}


def mismatch_metrics(batch: dict[str, torch.Tensor], dp_group: dist.ProcessGroup | None) -> dict[str, float]:
    """`training/rollout_probs_diff_{max,mean,std,valid}` and `training/rollout_actor_probs_pearson_corr` of
    the global batch: engine vs actor (`old_log_probs`) probabilities of the sampled tokens (collective over DP)."""
    full = gather_global(batch, ("rollout_log_probs", "old_log_probs", "response_mask"), dp_group)
    return rollout_mismatch_metrics(full["rollout_log_probs"], full["old_log_probs"], full["response_mask"])


class RolloutCorrector:
    """algorithm.rollout_correction for one run (every method is collective over DP or works on gathered data)."""

    def __init__(self, cfg: MppoConfig, dp_group: dist.ProcessGroup | None, *, old_log_prob_source: OldLogProbSource):
        self.params = correction_params(cfg.algorithm.rollout_correction)
        self.dp_group = dp_group
        self.bypass = self.params.bypass_mode
        # the update's forward has the rollout's weights: its log-probs are the old ones
        self.on_policy = not off_policy_update(cfg)
        # the update's forward log-probs are compared with the engine's when no separate pass was: on-policy reuse
        # (they are the old ones) and bypass mode (pi_theta at each row's first forward)
        self.metrics_after_update = old_log_prob_source is not OldLogProbSource.ACTOR_PASS
        if self.bypass and not self.on_policy:
            log.info("rollout correction bypass mode with an off-policy update (%s): no training/rollout_probs_* "
                     "metrics (the update's forwards do not all have the rollout's weights)", off_policy_update(cfg))

    def before_advantages(self, full: dict[str, torch.Tensor]) -> tuple[dict[str, float], tuple[str, ...]]:
        """Decoupled mode, old log-probs known: IS weights and rejection on the gathered global batch `full`
        (sets `rollout_is_weights`, replaces `response_mask` and keeps the old one as UNREJECTED_MASK).
        Returns (metrics, the keys of `full` changed for the workers)."""
        mask = full["response_mask"]
        if self.metrics_after_update or not bool(mask.any()):
            return {}, ()
        weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
            full["old_log_probs"], full["rollout_log_probs"], mask, **self.params.as_kwargs())
        changed: tuple[str, ...] = ()
        if weights is not None:
            full["rollout_is_weights"], changed = weights, ("rollout_is_weights",)
        if self.params.rollout_rs is not None:
            full[UNREJECTED_MASK], full["response_mask"] = mask, new_mask
            changed += ("response_mask",)
        return metrics, changed

    def after_update(self, batch: dict[str, torch.Tensor], forward_log_probs: torch.Tensor | None) -> dict[str, float]:
        """Metrics from the update's forward log-probs (reuse: the old ones; bypass: pi_theta at each row's first
        forward) against the engine's, over the global batch (collective over DP)."""
        if not self.metrics_after_update or forward_log_probs is None:
            return {}
        full = gather_global({**batch, "forward_log_probs": forward_log_probs},
                             ("rollout_log_probs", "forward_log_probs", "response_mask"), self.dp_group)
        actor, rollout, mask = full["forward_log_probs"], full["rollout_log_probs"], full["response_mask"]
        metrics = rollout_mismatch_metrics(rollout, actor, mask) if self.on_policy else {}
        if bool(mask.any()):
            metrics.update(compute_rollout_correction_and_rejection_mask(actor, rollout, mask,
                                                                         **self.params.as_kwargs())[2])
        return metrics
