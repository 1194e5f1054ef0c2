"""Rollout-correction bypass mode's policy losses (veRL 0.9.1 `compute_policy_loss_bypass_mode`,
`compute_policy_loss_reinforce`).

In bypass mode the trainer skips the old-log-prob pass and passes the ROLLOUT engine's log-probs as
`old_log_prob`: two policies (rollout, current) instead of three. The loss computes, from the current log-probs
(detached) against the rollout's, the IS weights and rejection mask of `config.rollout_correction`, then:

* loss_type "ppo_clip": vanilla PPO on the ratio pi / pi_rollout, masked by the rejection; the IS weights are
  NOT applied (the ratio already is the importance weight).
* loss_type "reinforce": L = -A * log_prob * w (w the IS weights, if `rollout_is` is set), masked.

The global batch facts (`batch_info`) are those of the mask before rejection (veRL's `global_batch_info`), so
rejected tokens lower the loss rather than re-weighting the rest. Everything happens per micro-batch, which is
exact for per-token and per-row criteria; batch normalisation of the weights would depend on the split, so the
config validation refuses it in bypass mode.

veRL registers the bypass loss as `loss_mode="bypass_mode"` and switches to it when bypass_mode is on; here
`algorithm.rollout_correction.bypass_mode=true` is the one switch (the actor then uses this loss), so it is not
in POLICY_LOSS_REGISTRY.
"""
from __future__ import annotations

import torch

from .agg import GlobalBatchInfo
from .masked import masked_mean
from .pg_losses_token import compute_policy_loss_vanilla
from .pg_registry import PolicyLossParams, aggregate_token_losses
from .rollout_correction import compute_rollout_correction_and_rejection_mask

__all__ = ["compute_policy_loss_reinforce", "compute_policy_loss_bypass_mode"]


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with optional IS weights: `L = -A * log_prob (* w)`, no ratio and no clipping;
    `actor/ppo_kl = masked_mean(rollout_log_prob - log_prob)`."""
    pg_losses = -advantages * log_prob
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    ppo_kl = masked_mean(-(log_prob - rollout_log_prob), response_mask)
    return pg_loss, {"actor/ppo_kl": ppo_kl.detach().item()}


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bypass mode: `old_log_prob` IS the rollout's; IS weights and rejection from pi / pi_rollout (module
    docstring). A `rollout_is_weights` argument is ignored (computed here). Metrics: the loss's and the
    `rollout_corr/...` ones of this micro-batch."""
    corr = config.rollout_correction if config is not None else None
    if corr is None:
        raise ValueError("loss_mode 'bypass_mode' needs PolicyLossParams.rollout_correction (the trainer sets it "
                         "from algorithm.rollout_correction with bypass_mode=true).")
    rollout_log_prob = old_log_prob
    weights, kept_mask, metrics = None, response_mask, {}
    if bool(response_mask.any()):  # veRL raises on a micro-batch without response tokens; it adds nothing here
        with torch.no_grad():
            weights, kept_mask, metrics = compute_rollout_correction_and_rejection_mask(
                log_prob.detach(), rollout_log_prob, response_mask, **corr.as_kwargs())
    if corr.loss_type == "reinforce":
        pg_loss, pg_metrics = compute_policy_loss_reinforce(
            rollout_log_prob, log_prob, advantages, kept_mask, loss_agg_mode, config=config,
            rollout_is_weights=weights, batch_info=batch_info)
    elif corr.loss_type == "ppo_clip":
        pg_loss, pg_metrics = compute_policy_loss_vanilla(
            rollout_log_prob, log_prob, advantages, kept_mask, loss_agg_mode, config=config,
            rollout_is_weights=None, batch_info=batch_info)
    else:
        raise ValueError(f"Invalid loss_type: {corr.loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    pg_metrics.update(metrics)
    return pg_loss, pg_metrics
