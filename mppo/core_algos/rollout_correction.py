"""Rollout correction: importance-sampling (IS) weights and rejection of off-policy tokens/sequences, for the gap
between the policy that generated a rollout (the engine: other kernels, precision, possibly stale weights) and
the policy being trained. veRL 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py` semantics and argument names.

Everything starts from the per-token log-ratio `lr = log pi_train - log pi_rollout` (`log_ratio`), where
pi_train gives the old log-probs (decoupled mode) or the current ones (bypass mode):

* IS weights (`compute_rollout_correction_weights`), `rollout_is`:
    "token":    w_t = exp(clamp(lr_t, +-20))
    "sequence": w_t = exp(clamp(sum_t lr_t m_t, +-20)) for every token of the row
  then `rollout_is_threshold` = a number u: TIS, w = min(w, u); a "lower_upper" string (e.g. "0.5_5.0"):
  IcePop, w = w where lower <= w <= upper, else 0. Weights are 0 on padding and detached.
  `rollout_is_batch_normalize` divides them by their mean over the batch given (tokens, or rows for "sequence").
* Rejection (`compute_rollout_rejection_mask`), `rollout_rs` = comma list of criteria that must all pass, on
  k1 = -lr, k2 = lr^2 / 2, k3 = exp(lr) - 1 - lr (lr clamped to +-20):
    token_k{1,2,3}        per token
    seq_{sum,mean}_k{1,2,3}  sum / mean over the row's tokens, rejects the whole row
    seq_max_k{2,3}        max over the row's tokens, rejects the whole row
  `rollout_rs_threshold` (one entry, or one per criterion, comma separated): k2/k3 an upper bound; k1
  "lower_upper" RATIO bounds, compared in log space with k1 itself, i.e. log(lower) <= -lr <= log(upper)
  (a single number u means lower = 1/u). Rejected tokens get response_mask 0.

Batch normalisation and every metric are over the tensors given: the trainer passes the GLOBAL batch, so they do
not depend on the DP split (veRL: the driver holds the global batch in decoupled mode).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masked import masked_mean, masked_sum
from .rollout_corr_metrics import SAFETY_BOUND, compute_is_metrics, compute_offpolicy_metrics, compute_rs_metrics

__all__ = [
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "ROLLOUT_LOSS_TYPES",
    "RolloutCorrectionParams",
    "parse_rollout_is_threshold",
    "parse_rollout_rs_thresholds",
    "parse_rollout_rs_options",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "compute_rollout_correction_and_rejection_mask",
]

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
ROLLOUT_LOSS_TYPES: tuple[str, ...] = ("ppo_clip", "reinforce")  # bypass mode's policy loss


@dataclass(frozen=True)
class RolloutCorrectionParams:
    """The knobs of `algorithm.rollout_correction` (veRL 0.9.1 RolloutCorrectionConfig, YAML defaults)."""

    rollout_is: str | None = None  # None | "token" | "sequence"
    rollout_is_threshold: str | float = 2.0  # number: TIS upper bound; "lower_upper": IcePop bounds
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    rollout_rs: str | None = None  # comma list of ROLLOUT_RS_OPTIONS, or None
    rollout_rs_threshold: str | float | None = None  # one entry, or one per rollout_rs option
    bypass_mode: bool = False  # old log-probs := the rollout's (no old-log-prob pass), loss_type decides the loss
    loss_type: str = "ppo_clip"  # bypass mode: "ppo_clip" (vanilla PPO, the ratio is the IS) | "reinforce"

    def as_kwargs(self) -> dict:
        """The arguments of compute_rollout_correction_and_rejection_mask."""
        return {"rollout_is": self.rollout_is, "rollout_is_threshold": self.rollout_is_threshold,
                "rollout_is_batch_normalize": self.rollout_is_batch_normalize, "rollout_rs": self.rollout_rs,
                "rollout_rs_threshold": self.rollout_rs_threshold}


# ---------------------------------------------------------------------------------------------------- thresholds
def _positive_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise ValueError(f"Invalid {what} {text!r}: not a number.") from exc
    if not value > 0:
        raise ValueError(f"{what} must be positive, got {text!r}.")
    return value


def parse_rollout_is_threshold(threshold_spec: str | float) -> tuple[float, float | None]:
    """(upper, lower or None): a number (or number-like string) is TIS's upper bound; "lower_upper" gives IcePop's
    bounds (0 < lower <= upper). A bool is a TypeError."""
    if isinstance(threshold_spec, bool) or not isinstance(threshold_spec, (int, float, str)):
        raise TypeError("rollout_is_threshold must be a float or a 'lower_upper' string, not "
                        f"{type(threshold_spec).__name__}.")
    if not isinstance(threshold_spec, str):
        return _positive_float(str(float(threshold_spec)), "rollout_is_threshold upper bound"), None
    spec = threshold_spec.strip()
    if not spec:
        raise ValueError("rollout_is_threshold must not be an empty string.")
    if "_" not in spec:
        return _positive_float(spec, "rollout_is_threshold upper bound"), None
    lower_text, upper_text = spec.split("_", 1)
    lower = _positive_float(lower_text, "rollout_is_threshold lower bound")
    upper = _positive_float(upper_text, "rollout_is_threshold upper bound")
    if lower > upper:
        raise ValueError(f"rollout_is_threshold lower bound must be <= upper bound, got {spec!r}.")
    return upper, lower


def parse_rollout_rs_options(rollout_rs: str) -> list[str]:
    """The criteria of a comma list, in order, duplicates dropped; ValueError naming an unknown one."""
    if not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    options: list[str] = []
    for option in (part.strip() for part in rollout_rs.split(",")):
        if not option:
            continue
        if option not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"Invalid rollout_rs option: {option}. Must be one of {sorted(ROLLOUT_RS_OPTIONS)}.")
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("rollout_rs must contain at least one valid option.")
    return options


def parse_rollout_rs_thresholds(options: list[str],
                                threshold_spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """option -> (lower or None, upper). One entry is shared by every option, else one per option (commas).
    k1 options take RATIO bounds "lower_upper" (a single u means lower = 1/u); k2/k3 a single positive bound."""
    if threshold_spec is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if isinstance(threshold_spec, (int, float)):
        specs = [str(threshold_spec)]
    elif isinstance(threshold_spec, str):
        specs = [part.strip() for part in threshold_spec.split(",") if part.strip()]
    else:
        raise TypeError("rollout_rs_threshold must be a string or numeric value specifying per-option thresholds.")
    if not specs:
        raise ValueError("rollout_rs_threshold must contain at least one threshold value.")
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold expects either one threshold shared by all options or exactly "
                         f"{len(options)} thresholds to match the provided rollout_rs options.")
    specs = specs * len(options) if len(specs) == 1 else specs
    thresholds: dict[str, tuple[float | None, float]] = {}
    for option, spec in zip(options, specs):
        what = f"threshold of rollout_rs option '{option}'"
        if option.endswith("k1"):
            if "_" in spec:
                lower_text, upper_text = spec.split("_", 1)
                lower, upper = _positive_float(lower_text, what), _positive_float(upper_text, what)
            else:
                upper = _positive_float(spec, what)
                lower = float(str(1.0 / upper))  # veRL goes through str(); the value is 1/upper exactly
            if lower > upper:
                raise ValueError(f"Thresholds for option '{option}' must be lower <= upper, got {spec}.")
            thresholds[option] = (lower, upper)
        else:
            if "_" in spec:
                raise ValueError(f"rollout_rs_threshold for option '{option}' must provide a single upper bound "
                                 f"without '_'. Received '{spec}'.")
            thresholds[option] = (None, _positive_float(spec, what))
    return thresholds


# ------------------------------------------------------------------------------------------------------ IS weights
def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(IS weights [B, T], `rollout_is_*` metrics): truncated (TIS) or band-passed (IcePop) pi_train / pi_rollout.

    Metrics describe the weights before batch normalisation (plus `rollout_is_batch_norm_factor` = the mean
    divided by, or 1.0 when it is <= 1e-8 and nothing is divided) and, for IcePop, `rollout_is_oob_ratio` = the
    token fraction outside the bounds. Batch mean: masked mean over tokens ("token"), or the mean of the row means
    over rows with a token ("sequence"), over the tensors given.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"Invalid rollout_is: {rollout_is}. Must be one of {set(ROLLOUT_IS_LEVELS)}.")
    upper, lower = parse_rollout_is_threshold(rollout_is_threshold)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_for_metrics = masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)  # [B, 1]
        raw = torch.exp(torch.clamp(log_ratio_for_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:  # TIS
        weights = raw.clamp(max=upper)
    else:  # IcePop
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = compute_is_metrics(weights, raw, log_ratio_for_metrics, response_mask, rollout_is, upper, lower)
    if lower is not None:
        outside = (raw < lower) | (raw > upper)
        metrics["rollout_is_oob_ratio"] = masked_mean(outside.float(), response_mask).item()
    weights = weights.detach()  # IS weights change the measure, not the objective: no gradient through them
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            row_means = masked_mean(weights, response_mask, axis=-1)
            rows_with_tokens = (response_mask.sum(dim=-1) > 0).to(dtype=weights.dtype)
            mean = (row_means * rows_with_tokens).sum() / rows_with_tokens.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


# ------------------------------------------------------------------------------------------------------- rejection
def _row_max(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Max over each row's masked tokens; 0 for a row without tokens."""
    neg_inf = torch.tensor(float("-inf"), device=values.device, dtype=values.dtype)
    row_max = values.masked_fill(~response_mask.bool(), neg_inf).max(dim=-1).values
    return torch.where(row_max == neg_inf, torch.zeros_like(row_max), row_max)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(response_mask with rejected tokens set to 0, `rollout_rs_*` metrics): a hard trust region on the
    divergence estimators k1/k2/k3 (see the module docstring), every listed criterion must pass.

    Metrics per criterion: `rollout_rs_<option>_{mean,max,min,std,fraction_high,fraction_low,seq_*}`,
    `_masked_fraction` (tokens) and `_seq_masked_fraction` (rows with a token); overall
    `rollout_rs_masked_fraction` (tokens) and `rollout_rs_seq_masked_fraction` (rows with a rejected token, over
    ALL rows, empty ones included, as veRL). An empty batch returns the mask unchanged and no metrics.
    """
    if rollout_rs is None or not isinstance(rollout_rs, str):
        raise ValueError("rollout_rs must be a non-empty string (comma separated for multiple options).")
    if rollout_rs_threshold is None:
        raise ValueError("rollout_rs_threshold must be provided for rejection sampling.")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    options = parse_rollout_rs_options(rollout_rs)
    thresholds = parse_rollout_rs_thresholds(options, rollout_rs_threshold)

    safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    estimators = {"k1": -safe, "k2": 0.5 * safe ** 2, "k3": torch.exp(safe) - 1.0 - safe}
    valid = response_mask.bool()
    rows_with_tokens = response_mask.sum(dim=-1) > 0
    row_reducers = {"sum": lambda v: masked_sum(v, response_mask, axis=-1),
                    "mean": lambda v: masked_mean(v, response_mask, axis=-1),
                    "max": lambda v: _row_max(v, response_mask)}
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        estimator = option[-2:]
        lower, upper = thresholds[option]
        is_k1 = estimator == "k1"
        # k1 bounds are ratio bounds, compared in log space
        upper_cmp = math.log(upper) if is_k1 else upper
        lower_cmp = math.log(lower) if is_k1 else 0.0

        def keep(stat: torch.Tensor) -> torch.Tensor:
            return (stat >= lower_cmp) & (stat <= upper_cmp) if is_k1 else stat <= upper_cmp

        if option.startswith("token_"):
            level, per_sequence = "token", None
            per_token = estimators[estimator]
            token_keep = keep(per_token)
        else:
            level = "sequence"
            per_sequence = row_reducers[option.split("_")[1]](estimators[estimator])
            token_keep = keep(per_sequence).unsqueeze(-1).expand_as(valid)
            per_token = per_sequence.unsqueeze(-1).expand_as(response_mask)
        metrics.update(compute_rs_metrics(option, per_token, response_mask, rows_with_tokens, level=level,
                                          per_sequence_values=per_sequence, rollout_rs_threshold=upper_cmp,
                                          rollout_rs_threshold_lower=lower_cmp, apply_lower_threshold=is_k1))
        token_keep_mask = token_keep.to(dtype=log_ratio.dtype)
        combined = combined * token_keep_mask
        row_kept = (~((~token_keep) & valid)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - token_keep_mask, response_mask).item()
        rows = rows_with_tokens.float()
        if rows.sum() > 0:
            row_kept_f = row_kept.to(dtype=log_ratio.dtype)
            metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (((1.0 - row_kept_f) * rows).sum()
                                                                   / rows.sum()).item()
        else:
            metrics[f"rollout_rs_{option}_seq_masked_fraction"] = 0.0
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    rejected = ~((combined > 0.5) & valid) & valid
    metrics["rollout_rs_seq_masked_fraction"] = rejected.any(dim=-1).float().mean().item()
    return (response_mask * combined).to(dtype=response_mask.dtype), metrics


# --------------------------------------------------------------------------------------------------------- unified
def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """(IS weights or None, response_mask after rejection, metrics prefixed `rollout_corr/`).

    `log_ratio = old_log_prob - rollout_log_prob`; IS weights when `rollout_is` and `rollout_is_threshold` are
    set, rejection when `rollout_rs` is set (then `rollout_rs_threshold` is required), and the off-policy
    diagnostics (`rollout_corr/kl`, `k3_kl`, `training_ppl`, `rollout_ppl`, `chi2_token`, ...) always. The
    weights are computed on the mask BEFORE rejection (veRL's order). veRL returns the weights wrapped in a
    DataProto; here they are the tensor.
    """
    if not bool(response_mask.any()):
        raise ValueError("response_mask must contain at least one valid token (1).")
    if old_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"old_log_prob shape {old_log_prob.shape} does not match rollout_log_prob shape "
                         f"{rollout_log_prob.shape}.")
    if old_log_prob.shape != response_mask.shape:
        raise ValueError(f"log_prob shape {old_log_prob.shape} does not match response_mask shape "
                         f"{response_mask.shape}.")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize)
        metrics.update(is_metrics)
    new_mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs_threshold must be explicitly provided when rollout_rs is enabled. "
                             "Set rollout_rs_threshold to the desired threshold value.")
        new_mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs=rollout_rs,
                                                              rollout_rs_threshold=rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    return weights, new_mask, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}
