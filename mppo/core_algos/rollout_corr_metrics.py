"""Diagnostics of rollout correction (veRL 0.9.1 `rollout_corr_helper.py`: compute_is_metrics, compute_rs_metrics,
compute_offpolicy_metrics), without the `rollout_corr/` prefix the unified function adds.

Notation: `lr = log pi_train - log pi_rollout` per token, `m` = response_mask. Every "mean" is over the masked
tokens of the whole tensor given unless it says "over rows"; the trainer passes the global batch. veRL's quirks
are kept and named where they occur (rows without a token count in the row means; thresholds are compared in
float32 because veRL builds them with `torch.tensor(python_float)`).
"""
from __future__ import annotations

import math

import torch

from .masked import masked_mean, masked_sum

__all__ = ["SAFETY_BOUND", "compute_is_metrics", "compute_rs_metrics", "compute_offpolicy_metrics"]

# exp() is taken of log-ratios clamped to +-20 (exp(20) ~ 4.9e8) so weights cannot overflow.
SAFETY_BOUND = 20.0


def _require_tokens(response_mask: torch.Tensor) -> None:
    if not bool(response_mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")


def _clamped_moments_std(values: torch.Tensor, response_mask: torch.Tensor, lo: float, hi: float) -> float:
    """sqrt(E[v^2] - E[v]^2) over the masked tokens of v clamped to [lo, hi]; 0 with fewer than two tokens."""
    if not response_mask.sum() > 1:
        return 0.0
    clamped = values.clamp(min=lo, max=hi)
    mean = masked_mean(clamped, response_mask)
    var = masked_mean(clamped.square(), response_mask) - mean.square()
    return torch.sqrt(torch.clamp(var, min=0.0)).item()


def compute_is_metrics(rollout_is_weights: torch.Tensor, raw_rollout_is_weights: torch.Tensor,
                       log_ratio_for_metrics: torch.Tensor, response_mask: torch.Tensor, rollout_is: str,
                       rollout_is_threshold: float, rollout_is_threshold_lower: float | None = None) -> dict[str, float]:
    """Statistics of the IS weights: `rollout_is_{mean,max,min,std,eff_sample_size}`, the fractions of raw
    ratios beyond the bounds, and per-row `rollout_is_seq_*` (lower bound default: 1 / upper).

    `log_ratio_for_metrics` is the unclamped per-token lr ("token") or per-row sum [B, 1] ("sequence"). For
    "sequence", max/min/fractions are over ALL rows (empty rows have lr 0) and `rollout_is_min` is exp of the
    unclamped minimum. ESS = 1 / E[(w / (E[w] + 1e-8))^2] of the weights clamped to [0, upper] (NaN when every
    weight is 0, where veRL divides by zero).
    """
    _require_tokens(response_mask)
    lower = 1.0 / rollout_is_threshold if rollout_is_threshold_lower is None else rollout_is_threshold_lower
    device = rollout_is_weights.device
    log_upper = torch.log(torch.tensor(rollout_is_threshold, device=device))  # float32, as veRL
    log_lower = torch.log(torch.tensor(lower, device=device))
    metrics: dict[str, float] = {}
    if rollout_is == "sequence":
        metrics["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        metrics["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:
        metrics["rollout_is_mean"] = masked_mean(rollout_is_weights, response_mask).item()
        metrics["rollout_is_ratio_fraction_high"] = masked_mean(
            (raw_rollout_is_weights > rollout_is_threshold).float(), response_mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean(
            (raw_rollout_is_weights < lower).float(), response_mask).item()
        valid = response_mask.bool()
        metrics["rollout_is_max"] = rollout_is_weights.masked_fill(~valid, float("-inf")).max().item()
        metrics["rollout_is_min"] = rollout_is_weights.masked_fill(~valid, float("inf")).min().item()
    metrics["rollout_is_std"] = _clamped_moments_std(rollout_is_weights, response_mask, 0.0, rollout_is_threshold)

    clamped = rollout_is_weights.clamp(min=0.0, max=rollout_is_threshold)
    normalized = clamped / (masked_mean(clamped, response_mask) + 1e-8)
    second_moment = masked_mean(normalized.square(), response_mask).item()
    metrics["rollout_is_eff_sample_size"] = 1.0 / second_moment if second_moment != 0 else math.nan

    if rollout_is_weights.dim() > 1:
        row_means = masked_mean(rollout_is_weights, response_mask, axis=-1)  # empty rows: 0, still counted
        metrics["rollout_is_seq_mean"] = row_means.mean().item()
        metrics["rollout_is_seq_std"] = row_means.std().item() if row_means.numel() > 1 else 0.0
        metrics["rollout_is_seq_max"] = row_means.max().item()
        metrics["rollout_is_seq_min"] = row_means.min().item()
        metrics["rollout_is_seq_max_deviation"] = (row_means - 1.0).abs().max().item()
        # raw (untruncated) row means: a mean of weights clamped to the upper bound can never exceed it
        raw_row_means = masked_mean(raw_rollout_is_weights, response_mask, axis=-1)
        metrics["rollout_is_seq_fraction_high"] = (raw_row_means > rollout_is_threshold).float().mean().item()
        metrics["rollout_is_seq_fraction_low"] = (raw_row_means < lower).float().mean().item()
    return metrics


def compute_rs_metrics(option_name: str, rs_statistic: torch.Tensor, response_mask: torch.Tensor,
                       seq_valid_mask: torch.Tensor, *, level: str, per_sequence_values: torch.Tensor | None,
                       rollout_rs_threshold: float, rollout_rs_threshold_lower: float,
                       apply_lower_threshold: bool) -> dict[str, float]:
    """Statistics of one rejection criterion, `rollout_rs_<option>_*`.

    `rs_statistic` is per token [B, T] (a sequence statistic broadcast over its row); the thresholds are those
    it is compared with (for the k1 options: the logs of the ratio bounds). Token-level max/min/fractions are over
    masked tokens, sequence-level ones over the rows that have a token; `_mean` is always token-weighted; `_std`
    is that of the statistic clamped to [lower (k1) or 0, upper].
    """
    _require_tokens(response_mask)
    prefix = f"rollout_rs_{option_name}"
    valid = response_mask.bool()
    seq_values = (per_sequence_values if per_sequence_values is not None
                  else masked_mean(rs_statistic, response_mask, axis=-1))
    if seq_values.dim() > 1:
        seq_values = seq_values.squeeze(-1)
    seq_valid = seq_values[seq_valid_mask]
    by_sequence = level == "sequence" and seq_valid.numel() > 0
    upper, lower = rollout_rs_threshold, rollout_rs_threshold_lower

    metrics = {f"{prefix}_mean": masked_mean(rs_statistic, response_mask).item()}
    if by_sequence:
        metrics[f"{prefix}_max"] = seq_valid.max().item()
        metrics[f"{prefix}_min"] = seq_valid.min().item()
        metrics[f"{prefix}_fraction_high"] = (seq_valid > upper).float().mean().item()
        metrics[f"{prefix}_fraction_low"] = ((seq_valid < lower).float().mean().item()
                                             if apply_lower_threshold else 0.0)
    else:
        metrics[f"{prefix}_max"] = rs_statistic.masked_fill(~valid, float("-inf")).max().item()
        metrics[f"{prefix}_min"] = rs_statistic.masked_fill(~valid, float("inf")).min().item()
        metrics[f"{prefix}_fraction_high"] = masked_mean((rs_statistic > upper).float(), response_mask).item()
        metrics[f"{prefix}_fraction_low"] = (masked_mean((rs_statistic < lower).float(), response_mask).item()
                                             if apply_lower_threshold else 0.0)
    metrics[f"{prefix}_std"] = _clamped_moments_std(rs_statistic, response_mask,
                                                    lower if apply_lower_threshold else 0.0, upper)
    if seq_valid.numel() > 0:
        metrics[f"{prefix}_seq_mean"] = seq_valid.mean().item()
        metrics[f"{prefix}_seq_std"] = seq_valid.std().item() if seq_valid.numel() > 1 else 0.0
        metrics[f"{prefix}_seq_max"] = seq_valid.max().item()
        metrics[f"{prefix}_seq_min"] = seq_valid.min().item()
        metrics[f"{prefix}_seq_max_deviation"] = seq_valid.abs().max().item()  # deviation from the ideal 0
        metrics[f"{prefix}_seq_fraction_high"] = (seq_valid > upper).float().mean().item()
        if apply_lower_threshold:
            metrics[f"{prefix}_seq_fraction_low"] = (seq_valid < lower).float().mean().item()
    else:  # unreachable after _require_tokens; kept as veRL has it
        for name in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation", "seq_fraction_high",
                     "seq_fraction_low"):
            metrics[f"{prefix}_{name}"] = 0.0
    return metrics


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None,
                              response_mask: torch.Tensor) -> dict[str, float]:
    """How far the training policy (`old_log_prob`) is from the rollout policy.

    Perplexities are batch means over ALL rows of exp(-row mean log-prob) (empty rows: exp(0) = 1). With rollout
    log-probs: `kl` = E[log pi_rollout - log pi_train] (tokens), `k3_kl` = E[exp(lr) - lr - 1] (unclamped),
    `log_ppl_diff{,_abs,_max,_min}` of the row mean log-probs, `ppl_ratio` = mean over rows of exp(log_ppl_diff),
    `chi2_token` = E[exp(clamp(lr))^2] - 1 and `chi2_seq` = mean over rows of exp(2 clamp(sum lr)) - 1.
    """
    _require_tokens(response_mask)
    train_row_mean = masked_mean(old_log_prob, response_mask, axis=-1)
    metrics = {"training_ppl": torch.exp(-train_row_mean).mean().item(),
               "training_log_ppl": (-train_row_mean).mean().item()}
    if rollout_log_prob is None:
        return metrics
    log_ratio = old_log_prob - rollout_log_prob
    metrics["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    metrics["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
    rollout_row_mean = masked_mean(rollout_log_prob, response_mask, axis=-1)
    metrics["rollout_ppl"] = torch.exp(-rollout_row_mean).mean().item()
    metrics["rollout_log_ppl"] = (-rollout_row_mean).mean().item()
    log_ppl_diff = rollout_row_mean - train_row_mean
    metrics["log_ppl_diff"] = log_ppl_diff.mean().item()
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean().item()
    metrics["log_ppl_diff_max"] = log_ppl_diff.max().item()
    metrics["log_ppl_diff_min"] = log_ppl_diff.min().item()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean().item()
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    metrics["chi2_token"] = (masked_mean(rho.square(), response_mask) - 1.0).item()
    row_log_ratio = torch.clamp(masked_sum(log_ratio, response_mask, axis=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    metrics["chi2_seq"] = (torch.exp(2.0 * row_log_ratio).mean() - 1.0).item()
    return metrics
