"""Policy losses whose per-token loss depends on other tokens of the sequence or batch (veRL 0.9.1 semantics):
GSPO and GMPO ("geo_mean") use sequence-level ratios, Clip-Cov and KL-Cov use batch covariance statistics.

veRL quirk kept for all four: the log-ratio is NOT clamped to +-20 (unlike vanilla), so huge ratios can appear.
"""
from __future__ import annotations

import torch

from .agg import GlobalBatchInfo
from .masked import masked_mean
from .pg_registry import (PolicyLossParams, aggregate_token_losses, clip_metrics, importance_ratio,
                          register_policy_loss)

__all__ = [
    "compute_policy_loss_gspo",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov",
]

_DEFAULT_PARAMS = PolicyLossParams()


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (https://arxiv.org/abs/2507.18071): sequence ratio `s_i = exp(sum_t lr * m / max(sum_t m, 1))`,
    used per token as `log r_it = log_prob - sg(log_prob) + sg(log s_i)` (value s_i, gradient of log_prob),
    clamped at max 10 in log space; `L = max(-A * r, -A * clamp(r, 1 - low, 1 + high))`.

    Aggregated with `loss_agg_mode` (this function's default is the paper's "seq-mean-token-mean"; the trainer
    passes actor.loss_agg_mode). pg_clipfrac = masked_mean(l2 > l1); pg_clipfrac_lower is 0; ppo_kl uses the
    unclamped log-ratio.
    """
    params = config or _DEFAULT_PARAMS
    log_ratio = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    seq_log_ratio = torch.sum(log_ratio * response_mask, dim=-1) / seq_lengths
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))

    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1 - params.low, 1 + params.high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)

    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    ppo_kl = masked_mean(-log_ratio, response_mask)
    return pg_loss, clip_metrics(pg_clipfrac, ppo_kl, 0.0)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (https://arxiv.org/abs/2507.20673): geometric mean of token ratios per sequence.

    `lc = clamp(lr, -low, high)`; `lmin = sign(A) * min(sign(A) * lr, sign(A) * lc)` (pessimistic side);
    `ratio_i = exp(sum_t lmin * m / (n_i + 1e-8))`, `adv_i = sum_t A * m / (n_i + 1e-8)`;
    `pg_loss = mean_i(-adv_i * ratio_i [* seq IS weight])`.

    veRL quirks kept: `loss_agg_mode` and `batch_info` are ignored, and the mean runs over **all** rows
    (fully-masked rows count as 0). Token IS weights become a per-sequence geometric mean
    `exp(sum_t log(w + 1e-10) * m / (n_i + 1e-8))`. pg_clipfrac = masked_mean((lr != lc) & (A > 0)),
    pg_clipfrac_lower = the same with A < 0.
    """
    params = config or _DEFAULT_PARAMS
    log_ratio = log_prob - old_log_prob
    ppo_kl = masked_mean(-log_ratio, response_mask)

    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -params.low, params.high)
    log_ratio_min = sign * torch.min(sign * log_ratio, sign * log_ratio_clamped)

    tokens = response_mask.sum(dim=-1)
    seq_ratio = torch.exp((log_ratio_min * response_mask).sum(dim=-1) / (tokens + 1e-8))
    seq_advantage = (advantages * response_mask).sum(dim=-1) / (tokens + 1e-8)
    pg_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        seq_is_weights = torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (tokens + 1e-8)
        )
        pg_losses = pg_losses * seq_is_weights
    pg_loss = torch.mean(pg_losses)

    clipped = torch.ne(log_ratio, log_ratio_clamped)
    pg_clipfrac = masked_mean((clipped * (advantages > 0)).float(), response_mask)
    pg_clipfrac_lower = masked_mean((clipped * (advantages < 0)).float(), response_mask)
    return pg_loss, clip_metrics(pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (https://arxiv.org/abs/2505.22617): PPO clip without dual clip, plus dropping the loss (and
    gradient) of a few tokens with high advantage/log-prob covariance.

    `cov = (A - masked_mean(A)) * (lp - masked_mean(lp))`, excluded (-inf) on masked tokens and tokens already
    clipped (l2 > l1). Candidates have `clip_cov_lb < cov < clip_cov_ub`; `min(max(int(clip_cov_ratio * sum(m)),
    1), #candidates)` of them are chosen with `torch.randperm` (the global RNG, as veRL: results are random
    unless seeded) and get loss 0. Metrics: pg_clipfrac = masked fraction of dropped tokens, ppo_kl.
    """
    params = config or _DEFAULT_PARAMS
    if not params.clip_cov_ratio > 0:
        raise ValueError(f"loss_mode 'clip_cov' needs clip_cov_ratio > 0, got {params.clip_cov_ratio}.")
    log_ratio, ratio, ppo_kl = importance_ratio(log_prob, old_log_prob, response_mask, clamp=False)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - params.low, 1 + params.high)

    with torch.no_grad():
        clipped_by_ppo = (pg_losses2 > pg_losses1) & (response_mask > 0)
        cov = (advantages - masked_mean(advantages, response_mask)) * (
            log_prob - masked_mean(log_prob, response_mask)
        )
        cov[response_mask == 0] = -torch.inf
        cov[clipped_by_ppo] = -torch.inf
        num_to_drop = max(int(params.clip_cov_ratio * response_mask.sum().item()), 1)
        candidates = torch.nonzero((cov < params.clip_cov_ub) & (cov > params.clip_cov_lb) & (response_mask > 0))
        if len(candidates) > 0:
            # Same randperm call as veRL, so a seeded run drops the same tokens.
            perm = torch.randperm(len(candidates))
            candidates = candidates[perm[: min(num_to_drop, len(candidates))]]
        keep = torch.ones_like(advantages)
        keep[candidates[:, 0], candidates[:, 1]] = 0

    pg_clipfrac = masked_mean((keep == 0).float(), response_mask)
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * keep
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, clip_metrics(pg_clipfrac, ppo_kl)


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossParams | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    batch_info: GlobalBatchInfo | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (https://arxiv.org/abs/2505.22617): `L = -A * ratio` (unclipped), plus `ppo_kl_coef * |lr|` on the
    `max(1, int(n_valid * kl_cov_ratio))` valid tokens with the largest covariance
    `(A - mean(A)) * (lp - mean(lp))` (plain means over the valid tokens, in row-major order, `torch.topk`).
    Metrics: only `actor/ppo_kl = masked_mean(|lr|)`.
    """
    params = config or _DEFAULT_PARAMS
    if not params.kl_cov_ratio > 0:
        raise ValueError(f"loss_mode 'kl_cov' needs kl_cov_ratio > 0, got {params.kl_cov_ratio}.")
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    ppo_kl_abs = masked_mean(log_ratio.abs(), response_mask)
    pg_losses = -advantages * ratio
    pg_losses_kl = -advantages * ratio + params.ppo_kl_coef * abs_kl

    with torch.no_grad():
        valid = response_mask > 0
        valid_flat_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
        valid_adv = advantages[valid].detach().reshape(-1).cpu()
        valid_logp = log_prob[valid].detach().reshape(-1).cpu()
        penalised = torch.zeros(advantages.numel(), dtype=torch.bool, device=advantages.device)
        if len(valid_adv) > 0:
            cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
            top = torch.topk(cov, max(1, int(len(cov) * params.kl_cov_ratio)), largest=True).indices
            penalised[valid_flat_idx[top.to(valid_flat_idx.device)]] = True
        penalised = penalised.view_as(advantages)

    pg_losses = torch.where(penalised, pg_losses_kl, pg_losses)
    pg_loss = aggregate_token_losses(pg_losses, response_mask, loss_agg_mode, rollout_is_weights, batch_info)
    return pg_loss, {"actor/ppo_kl": ppo_kl_abs.detach().item()}
