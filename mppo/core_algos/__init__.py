"""PPO math for mppo: advantages, policy/value/entropy losses, KL penalties and controllers, loss aggregation.

Pure torch (+ numpy), numerically equal to veRL 0.9.1 including its quirks (each one is named in the docstring
of the function that has it; the full list is in ppo_math.md section 7). Modules:

  masked.py            masked_sum/mean/var/whiten, entropy_from_logits, clip_by_value
  agg.py               agg_loss and the global-batch facts it needs (GlobalBatchInfo)
  kl.py                kl_penalty estimators, Fixed/Adaptive KL controllers, apply_kl_penalty
  adv_registry.py      ADV_ESTIMATOR_REGISTRY: each estimator and the inputs it declares it needs
  adv_token.py         GAE, REINFORCE++, ReMax
  adv_group.py         GRPO, RLOO, OPO, GPG, pass@k, REINFORCE++-baseline (grouped by prompt uid)
  adv_otb.py           optimal token baseline (per-time-step group baseline), plain and multi-turn
  advantages.py        compute_advantage: dispatch by algorithm.adv_estimator
  pg_registry.py       POLICY_LOSS_REGISTRY and PolicyLossParams (per-mode knobs)
  pg_losses_token.py   vanilla (dual clip, clip-higher), dppo_tv/kl, cispo, sapo, gpg, dro
  pg_losses_coupled.py gspo, geo_mean, clip_cov, kl_cov
  losses.py            compute_policy_loss / compute_value_loss / compute_entropy_loss
  rollout_correction.py  rollout correction: IS weights (TIS / IcePop), rejection masks, the unified function
  rollout_corr_metrics.py  their rollout_corr/ diagnostics (IS, rejection, off-policy KL / PPL / chi2)
  pg_losses_bypass.py  rollout-correction bypass mode's losses (PPO clip or REINFORCE on pi / pi_rollout)

Imports only torch and numpy, so mppo.config can import the registries cheaply.
"""
from __future__ import annotations

from .adv_group import (
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    group_rows,
)
from .adv_otb import compute_multi_turn_optimal_token_baseline_advantage, compute_optimal_token_baseline_advantage
from .adv_registry import (
    ADV_ESTIMATOR_REGISTRY,
    BATCH_INPUTS,
    EstimatorSpec,
    estimator_spec,
    estimators_needing,
    get_adv_estimator_fn,
    register_adv_est,
)
from .adv_token import (
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
)
from .advantages import compute_advantage
from .agg import AGG_LOSS_MODES, GlobalBatchInfo, agg_loss, agg_token_weights
from .kl import (
    KL_CONTROLLER_TYPES,
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    UnknownKLPenaltyError,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
)
from .losses import compute_entropy_loss, compute_policy_loss, compute_value_loss
from .masked import clip_by_value, entropy_from_logits, masked_mean, masked_sum, masked_var, masked_whiten
from .pg_losses_coupled import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
)
from .pg_losses_token import (
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_gpg,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from .pg_registry import POLICY_LOSS_REGISTRY, PolicyLossParams, get_policy_loss_fn, register_policy_loss
from .pg_losses_bypass import compute_policy_loss_bypass_mode, compute_policy_loss_reinforce
from .rollout_corr_metrics import compute_is_metrics, compute_offpolicy_metrics, compute_rs_metrics
from .rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_LOSS_TYPES,
    ROLLOUT_RS_OPTIONS,
    RolloutCorrectionParams,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
    parse_rollout_is_threshold,
    parse_rollout_rs_options,
    parse_rollout_rs_thresholds,
)

# The built-in estimators that declared critic values / prompt groups (validation asks `estimator_spec` instead,
# so that estimators registered later count too).
ESTIMATORS_NEEDING_CRITIC: frozenset[str] = estimators_needing("values")
ESTIMATORS_NEEDING_GROUPS: frozenset[str] = estimators_needing("index")

__all__ = [
    # masked helpers
    "masked_sum", "masked_mean", "masked_var", "masked_whiten", "entropy_from_logits", "clip_by_value",
    # aggregation
    "AGG_LOSS_MODES", "GlobalBatchInfo", "agg_loss", "agg_token_weights",
    # KL
    "KL_PENALTY_TYPES", "KL_CONTROLLER_TYPES", "UnknownKLPenaltyError", "kl_penalty", "compute_rewards",
    "FixedKLController", "AdaptiveKLController", "get_kl_controller", "apply_kl_penalty",
    # advantages
    "ADV_ESTIMATOR_REGISTRY", "BATCH_INPUTS", "EstimatorSpec", "ESTIMATORS_NEEDING_CRITIC",
    "ESTIMATORS_NEEDING_GROUPS", "estimator_spec", "estimators_needing", "register_adv_est", "get_adv_estimator_fn", "compute_advantage", "group_rows",
    "compute_gae_advantage_return", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage", "compute_grpo_outcome_advantage", "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage", "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_opo_outcome_advantage", "compute_gpg_outcome_advantage", "compute_grpo_passk_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage", "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    # policy losses
    "POLICY_LOSS_REGISTRY", "PolicyLossParams", "register_policy_loss", "get_policy_loss_fn",
    "compute_policy_loss", "compute_policy_loss_vanilla", "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl", "compute_policy_loss_cispo", "compute_policy_loss_sapo",
    "compute_policy_loss_gpg", "compute_policy_loss_dro", "compute_policy_loss_gspo",
    "compute_policy_loss_geo_mean", "compute_policy_loss_clip_cov", "compute_policy_loss_kl_cov",
    "compute_policy_loss_reinforce", "compute_policy_loss_bypass_mode",
    # value / entropy
    "compute_value_loss", "compute_entropy_loss",
    # rollout correction
    "ROLLOUT_IS_LEVELS", "ROLLOUT_RS_OPTIONS", "ROLLOUT_LOSS_TYPES", "RolloutCorrectionParams",
    "parse_rollout_is_threshold", "parse_rollout_rs_options", "parse_rollout_rs_thresholds",
    "compute_rollout_correction_weights", "compute_rollout_rejection_mask",
    "compute_rollout_correction_and_rejection_mask", "compute_is_metrics", "compute_rs_metrics",
    "compute_offpolicy_metrics",
]
