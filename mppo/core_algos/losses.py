"""Public loss entry points: the policy loss by mode name, the clipped value loss and the entropy loss."""
from __future__ import annotations

from typing import Any

import torch

from . import pg_losses_coupled, pg_losses_token  # noqa: F401  (importing them registers the loss modes)
from .agg import GlobalBatchInfo, agg_loss
from .masked import clip_by_value, entropy_from_logits, masked_mean
from .pg_registry import PolicyLossParams, get_policy_loss_fn

__all__ = ["compute_policy_loss", "compute_value_loss", "compute_entropy_loss"]


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    loss_mode: str = "vanilla",
    clip_ratio_low: float | None = 0.2,
    clip_ratio_high: float | None = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    **mode_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of `loss_mode` (see POLICY_LOSS_REGISTRY) with veRL 0.9.1 numerics.

    `mode_kwargs` are the other `PolicyLossParams` fields (clip_ratio, tau_pos, tau_neg, clip_cov_ratio,
    clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, dro_beta). dp_size / batch_num_tokens /
    global_batch_size / loss_scale_factor describe the global batch (`agg_loss`). Returns the scalar loss and
    the mode's metrics as python floats: `actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower` for the
    clipping modes; clip_cov reports the first two, kl_cov and dro only `actor/ppo_kl`, gpg none (as veRL).
    """
    unknown = sorted(set(mode_kwargs) - set(PolicyLossParams.field_names()))
    if unknown:
        raise TypeError(
            f"compute_policy_loss: unknown policy-loss knob(s) {unknown}; valid ones are "
            f"{list(PolicyLossParams.field_names())}."
        )
    params = PolicyLossParams(
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, **mode_kwargs
    )
    batch_info = GlobalBatchInfo(
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    loss_fn = get_policy_loss_fn(loss_mode)
    return loss_fn(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config=params,
        rollout_is_weights=rollout_is_weights,
        batch_info=batch_info,
    )


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: `vpc = clip(vpreds, values - c, values + c)`,
    `vf_loss = 0.5 * agg_loss(max((vpreds - R)^2, (vpc - R)^2), m)`; `vf_clipfrac = masked_mean((vpc - R)^2 >
    (vpreds - R)^2, m)` (strict >, a 0-d tensor as in veRL)."""
    vpreds_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpreds_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(
        torch.max(vf_losses1, vf_losses2),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean"
) -> torch.Tensor:
    """`agg_loss(entropy_from_logits(logits), m, mode)` for logits `(bs, T, V)`; no global-batch arguments, as in
    veRL (the trainer aggregates entropy itself with the global batch info)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
