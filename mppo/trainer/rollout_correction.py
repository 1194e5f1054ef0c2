"""What the trainer does with the rollout engine's own log-probs (`rollout_log_probs`) each step.

- `mismatch_metrics`: veRL's rollout-vs-actor probability metrics (`training/rollout_probs_diff_*`), on the
  global batch (gathered over DP), as soon as the actor's old log-probs are known: after the old-log-prob pass,
  or after the update when the update's own forward supplied them (`actor.reuse_on_policy_log_prob`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mppo.trainer.metrics import rollout_mismatch_metrics
from mppo.trainer.rollout_batch import all_gather_rows


def gather_global(batch: dict[str, torch.Tensor], keys: tuple[str, ...],
                  dp_group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    """The global batch's `keys` (this rank's rows concatenated over DP in rank order), on the CPU."""
    return {k: all_gather_rows(batch[k].detach().cpu(), dp_group) for k in keys}


def mismatch_metrics(batch: dict[str, torch.Tensor], dp_group: dist.ProcessGroup | None) -> dict[str, float]:
    """`training/rollout_probs_diff_{max,mean,std,valid}` and `training/rollout_actor_probs_pearson_corr` of
    the global batch: engine vs actor (`old_log_probs`) probabilities of the sampled tokens (collective over DP)."""
    full = gather_global(batch, ("rollout_log_probs", "old_log_probs", "response_mask"), dp_group)
    return rollout_mismatch_metrics(full["rollout_log_probs"], full["old_log_probs"], full["response_mask"])
