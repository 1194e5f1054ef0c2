"""Registry of policy-gradient losses (`actor.policy_loss.loss_mode`) and their knobs.

Every registered loss has one signature:

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config: PolicyLossParams | None = None, rollout_is_weights=None, batch_info: GlobalBatchInfo | None = None)
       -> (pg_loss: 0-d tensor, metrics: dict[str, float])

`config` replaces veRL's ActorConfig with the few fields the losses read; `batch_info` is veRL's
`config.global_batch_info` (global counts for `agg_loss`), kept apart because it changes per micro-batch.
`rollout_is_weights`, when given, multiplies the per-token loss before aggregation.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Protocol

import torch

from .agg import GlobalBatchInfo, agg_loss
from .masked import masked_mean
from .rollout_correction import RolloutCorrectionParams

__all__ = [
    "PolicyLossParams",
    "PolicyLossFn",
    "POLICY_LOSS_REGISTRY",
    "register_policy_loss",
    "get_policy_loss_fn",
    "aggregate_token_losses",
    "importance_ratio",
    "clip_metrics",
]


@dataclass(frozen=True)
class PolicyLossParams:
    """Per-mode knobs of the policy losses (defaults = veRL 0.9.1 ActorConfig / PolicyLossConfig)."""

    clip_ratio: float = 0.2  # PPO clip epsilon; only a fallback when clip_ratio_low/high is None
    clip_ratio_low: float | None = 0.2  # ratio lower clip 1 - low (DPPO: divergence bound for A <= 0)
    clip_ratio_high: float | None = 0.2  # ratio upper clip 1 + high ("clip-higher"; DPPO: bound for A > 0)
    clip_ratio_c: float = 3.0  # dual-clip bound for A < 0 (vanilla, must be > 1); DPPO: IS-ratio truncation
    tau_pos: float = 1.0  # SAPO gate temperature for A > 0
    tau_neg: float = 1.05  # SAPO gate temperature for A <= 0
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of valid tokens whose loss is dropped
    clip_cov_lb: float = 1.0  # clip_cov: covariance lower bound of the candidates (exclusive)
    clip_cov_ub: float = 5.0  # clip_cov: covariance upper bound of the candidates (exclusive)
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of valid tokens that get the |log-ratio| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that penalty
    dro_beta: float | None = None  # dro: quadratic log-ratio penalty; required (> 0) for loss_mode "dro"
    rollout_correction: RolloutCorrectionParams | None = None  # bypass_mode: IS weights / rejection / loss_type

    @property
    def low(self) -> float:
        """The effective lower clip ratio (clip_ratio_low, else clip_ratio)."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """The effective upper clip ratio (clip_ratio_high, else clip_ratio)."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class PolicyLossFn(Protocol):
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = ...,
        config: PolicyLossParams | None = ...,
        rollout_is_weights: torch.Tensor | None = ...,
        batch_info: GlobalBatchInfo | None = ...,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name` (the value of `actor.policy_loss.loss_mode`)."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSS_REGISTRY[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss registered under `name`; ValueError listing the valid modes otherwise."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"Unknown policy loss_mode {name!r}; valid modes are {sorted(POLICY_LOSS_REGISTRY)}.")
    return POLICY_LOSS_REGISTRY[name]


_NO_BATCH_INFO = GlobalBatchInfo()


def aggregate_token_losses(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    batch_info: GlobalBatchInfo | None,
) -> torch.Tensor:
    """The common tail of the policy losses: weight the per-token loss by the rollout IS weights (if any), then
    `agg_loss` with the global batch facts."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    info = batch_info or _NO_BATCH_INFO
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **info.as_kwargs())


def importance_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
                     clamp: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-ratio lr = log_prob - old_log_prob, ratio = exp(lr), ppo_kl = masked_mean(-lr)): the preamble of the
    ratio-based losses. `clamp`: veRL's token losses clamp lr to +-20 before exp() "for stability", and the
    clamped value feeds ppo_kl too; the sequence-coupled ones do not."""
    log_ratio = log_prob - old_log_prob
    if clamp:
        log_ratio = torch.clamp(log_ratio, min=-20.0, max=20.0)
    return log_ratio, torch.exp(log_ratio), masked_mean(-log_ratio, response_mask)


def clip_metrics(pg_clipfrac: torch.Tensor | float, ppo_kl: torch.Tensor | float,
                 pg_clipfrac_lower: torch.Tensor | float | None = None) -> dict[str, float]:
    """A policy loss's metrics as veRL returns them: Python floats; `pg_clipfrac_lower` None leaves its key out."""
    def value(v: torch.Tensor | float) -> float:
        return v.detach().item() if isinstance(v, torch.Tensor) else v

    metrics = {"actor/pg_clipfrac": value(pg_clipfrac), "actor/ppo_kl": value(ppo_kl)}
    if pg_clipfrac_lower is not None:
        metrics["actor/pg_clipfrac_lower"] = value(pg_clipfrac_lower)
    return metrics
