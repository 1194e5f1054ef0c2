"""Policy losses whose per-token loss depends only on that token (veRL 0.9.1 semantics):
vanilla PPO (clip-higher, dual clip), DPPO-TV / DPPO-KL, CISPO, SAPO, GPG and DRO.

Notation: `lr = log_prob - old_log_prob` (the log importance ratio), `ratio = exp(lr)`, `A` = advantages,
`m` = response_mask. Metrics are python floats; `ppo_kl = masked_mean(-lr, m)`.
"""
from __future__ import annotations

import torch

from .agg import GlobalBatchInfo
from .masked import masked_mean
from .pg_registry import (PolicyLossParams, aggregate_token_losses, clip_metrics, importance_ratio,
                          register_policy_loss)

__all__ = [
    "compute_policy_loss_vanilla",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_cispo",
    "compute_policy_loss_sapo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_dro",
]

_DEFAULT_PARAMS = PolicyLossParams()


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (https://arxiv.org/abs/1707.06347) with asymmetric clip (1 - low, 1 + high) and
    dual clip (https://arxiv.org/abs/1912.09729):

        l1 = -A * ratio;  l2 = -A * clamp(ratio, 1 - low, 1 + high);  c1 = max(l1, l2)
        l3 = -A * clip_ratio_c;  L = min(l3, c1) where A < 0, else c1

    veRL quirks kept: the log-ratio is clamped to +-20 (and `ppo_kl` uses the clamped value); dual clip applies
    only to strictly negative advantages (A == 0 takes the standard branch); clip fractions use strict `>`:
    `pg_clipfrac = masked_mean(l2 > l1)`, `pg_clipfrac_lower = masked_mean((c1 > l3) & (A < 0))`.
    Gradient wrt log_prob: `-A * ratio * w` on tokens where l1 is active (w = agg weight), 0 where clipped.
    """
    params = config or _DEFAULT_PARAMS
    clip_ratio_c = params.clip_ratio_c
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be > 1.0, got {clip_ratio_c}.")
    log_ratio, ratio, ppo_kl = importance_ratio(log_prob, old_log_prob, response_mask, clamp=True)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, clip_metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def _dppo_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    params: PolicyLossParams,
    rollout_is_weights: torch.Tensor | None,
    batch_info: GlobalBatchInfo | None,
    divergence: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    log_ratio, ratio, ppo_kl = importance_ratio(log_prob, old_log_prob, response_mask, clamp=True)
    # Truncated IS instead of a dual clip (DPPO paper, section 5.4); the truncated ratio carries no gradient.
    truncated_ratio = torch.clamp(ratio, max=params.clip_ratio_c).detach()

    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        valid_positive = (prob - old_prob) <= params.high
        valid_negative = (prob - old_prob) >= -params.low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        valid_positive = (binary_kl <= params.high) | (prob <= old_prob)
        valid_negative = (binary_kl <= params.low) | (prob >= old_prob)
    valid_mask = torch.where(advantages > 0, valid_positive, valid_negative).detach().float()

    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    pg_clipfrac = masked_mean((1.0 - valid_mask).float(), response_mask)
    pg_clipfrac_lower = masked_mean((ratio > params.clip_ratio_c).float() * valid_mask, response_mask)
    return pg_loss, clip_metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (https://arxiv.org/abs/2602.04879): `L = -A * sg(min(ratio, clip_ratio_c)) * log_prob * valid`
    where a token is valid if `p - p_old <= high` (A > 0) or `p - p_old >= -low` (A <= 0), p = exp(log_prob).
    clip_ratio_low/high are divergence bounds here, not ratio clips. Metrics: pg_clipfrac = invalid fraction,
    pg_clipfrac_lower = fraction of valid tokens whose ratio was truncated."""
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                      config or _DEFAULT_PARAMS, rollout_is_weights, batch_info, divergence="tv")


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL: as dppo_tv, but a token is valid if the binary KL
    `p_old * (lp_old - lp) + (1 - p_old) * log((1 - p_old + 1e-8) / (1 - p + 1e-8))` is `<= high` or `p <= p_old`
    (A > 0), resp. `<= low` or `p >= p_old` (A <= 0)."""
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                      config or _DEFAULT_PARAMS, rollout_is_weights, batch_info, divergence="kl")


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (https://arxiv.org/abs/2506.13585): `L = -sg(clamp(ratio, 1 - low, 1 + high)) * A * log_prob`, ratio from
    the +-20-clamped log-ratio. Gradient flows through log_prob only, on every token (clipped ones too).
    pg_clipfrac = masked_mean(ratio != clipped ratio); pg_clipfrac_lower is always 0."""
    params = config or _DEFAULT_PARAMS
    log_ratio, ratio, ppo_kl = importance_ratio(log_prob, old_log_prob, response_mask, clamp=True)
    clipped_ratio = torch.clamp(ratio, 1 - params.low, 1 + params.high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).float(), response_mask)
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, clip_metrics(pg_clipfrac, ppo_kl, 0.0)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO (https://arxiv.org/abs/2511.20347): smooth gate instead of a hard clip,
    `L = -gate * A` with `gate = sigmoid(tau * (ratio - 1)) * 4 / tau`, tau = tau_pos if A > 0 else tau_neg,
    ratio from the +-20-clamped log-ratio.

    veRL quirk kept: always aggregated with "seq-mean-token-mean"; `loss_agg_mode` is ignored.
    pg_clipfrac and pg_clipfrac_lower are always 0.
    """
    params = config or _DEFAULT_PARAMS
    tau_pos = torch.as_tensor(params.tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(params.tau_neg, dtype=advantages.dtype, device=advantages.device)
    log_ratio, ratio, ppo_kl = importance_ratio(log_prob, old_log_prob, response_mask, clamp=True)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    pg_loss = aggregate_token_losses(pg_losses, response_mask, "seq-mean-token-mean", rollout_is_weights, batch_info)
    return pg_loss, clip_metrics(0.0, ppo_kl, 0.0)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (https://arxiv.org/abs/2504.02546): plain policy gradient `L = -log_prob * A`, no ratio; metrics `{}`."""
    pg_losses = -log_prob * advantages
    return aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info), {}


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct Reward Optimization: `L = -(log_prob * A - 0.5 * dro_beta * lr^2)` (lr unclamped); needs
    `dro_beta > 0` (ValueError otherwise). Metrics: only `actor/ppo_kl`."""
    params = config or _DEFAULT_PARAMS
    beta = params.dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"loss_mode 'dro' needs policy_loss.dro_beta > 0, got {beta}.")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, {"actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach().item()}
