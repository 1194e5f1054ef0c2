"""The per-token half of the fused PPO loss: given a token's log-prob and entropy, its loss terms and the
gradient of the aggregated loss w.r.t. both — closed forms of core_algos' vanilla policy loss and KL estimators
(the reference these are tested against), O(tokens) work in torch, shared by the torch and Triton backends.

The aggregated loss of the tokens given to the fused kernel is
    L = Σ_i w_i · (pg_i · isw_i − entropy_coeff · H_i + kl_loss_coef · kl_i)
where w_i is the token's weight in core_algos.agg_loss (core_algos.agg_token_weights) — every loss_agg_mode is
linear in the token losses with weights fixed by the response mask and GlobalBatchInfo — and pg_i / kl_i are
per-token functions of the log-prob. So ∂L/∂logp_i and ∂L/∂H_i are known as soon as the token's log-prob is,
which is what lets the kernel produce the gradients during its forward.

Gradients follow torch autograd's rules for the reference formulas exactly, ties included: max/min split the
gradient evenly between equal arguments, clamp passes it at the bounds, |x| has gradient sign(x) (0 at 0).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from mppo.core_algos import KL_PENALTY_TYPES

from . import row_stats

LOG_RATIO_CLAMP = 20.0  # veRL clamps the PPO log-ratio to ±20 before exp (and ppo_kl uses the clamped value)
K3_LOG_RATIO_CLAMP = 20.0  # low_var_kl: clamp of ref - logp
K3_VALUE_CLAMP = 10.0  # low_var_kl: clamp of the estimate
PER_TOKEN_FIELDS = ("advantages", "weights", "mask", "old_log_prob", "rollout_is_weights", "ref_log_prob")


@dataclass
class PPOTokenLoss:
    """What the fused loss needs per token (all [N], aligned with the kernel's hidden rows) and its knobs.

    The policy loss is veRL 0.9.1's "vanilla" (asymmetric clip, dual clip only where A < 0); the optional terms
    are the entropy bonus and the KL-to-reference loss (core_algos.kl_penalty estimators, "+" variants included).
    """

    advantages: torch.Tensor
    weights: torch.Tensor  # each token's weight in the aggregated loss (agg_token_weights); 0 = not in the loss
    mask: torch.Tensor  # response mask values (metrics are masked means over these)
    old_log_prob: Optional[torch.Tensor] = None  # None: on-policy, the old policy is this forward's (ratio 1)
    rollout_is_weights: Optional[torch.Tensor] = None  # per-token factor on the policy loss
    ref_log_prob: Optional[torch.Tensor] = None  # needed when kl_loss_coef != 0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    kl_loss_coef: float = 0.0  # 0: no KL term
    kl_loss_type: str = "low_var_kl"

    def validate(self, n: int) -> None:
        for name in PER_TOKEN_FIELDS:
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"PPOTokenLoss.{name} must be [{n}] (one value per hidden row), got {tuple(t.shape)}")
            if t is not None and t.requires_grad:
                raise ValueError(f"PPOTokenLoss.{name} requires grad; the fused loss differentiates only hidden and "
                                 "weight (veRL treats these as data): detach it")
        if not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c (the dual-clip bound) must be > 1.0, got {self.clip_ratio_c}")
        if self.kl_loss_coef != 0:
            if self.kl_loss_type not in KL_PENALTY_TYPES:
                raise ValueError(f"kl_loss_type must be one of {list(KL_PENALTY_TYPES)}, got {self.kl_loss_type!r}")
            if self.ref_log_prob is None:
                raise ValueError("kl_loss_coef != 0 needs ref_log_prob")

    def to(self, dtype: torch.dtype) -> "PPOTokenLoss":
        """A copy whose per-token tensors are contiguous `dtype` (once per call, not per chunk)."""
        return replace(self, **{name: getattr(self, name).to(dtype).contiguous() for name in PER_TOKEN_FIELDS
                                if getattr(self, name) is not None})


@dataclass
class TokenTerms:
    """Per-token results for rows [r0, r1): loss terms, metric indicators, and the gradient coefficients."""

    pg: torch.Tensor  # clipped policy loss × rollout IS weight
    kl: Optional[torch.Tensor]  # KL estimate (None without a KL term)
    clipped: torch.Tensor  # l2 > l1 (veRL's pg_clipfrac indicator)
    clipped_lower: torch.Tensor  # dual clip active: (c1 > l3) & (A < 0)
    neg_log_ratio: torch.Tensor  # −clamp(logp − old, ±20) (veRL's ppo_kl)
    g_log_prob: torch.Tensor  # ∂L/∂logp
    g_entropy: Optional[torch.Tensor]  # ∂L/∂H (None when entropy_coeff == 0)


def _where(cond: torch.Tensor, a, b) -> torch.Tensor:
    return torch.where(cond, a, b)


def _vanilla(log_prob: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, low: float, high: float, clip_c: float):
    """(loss, d loss/d log_prob, clipped, clipped_lower, −clamped log-ratio) of compute_policy_loss_vanilla."""
    log_ratio_raw = log_prob - old
    log_ratio = log_ratio_raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -adv * clip_c
    negative = adv < 0
    loss = _where(negative, torch.minimum(loss_dual_bound, loss_ppo), loss_ppo)

    zero = torch.zeros_like(ratio)
    d_unclipped = -adv * ratio
    in_clip = (ratio >= 1.0 - low) & (ratio <= 1.0 + high)
    d_clipped = _where(in_clip, d_unclipped, zero)
    d_ppo = _where(loss_unclipped > loss_clipped, d_unclipped,
                   _where(loss_unclipped < loss_clipped, d_clipped, 0.5 * (d_unclipped + d_clipped)))
    d_dual = _where(loss_ppo < loss_dual_bound, d_ppo, _where(loss_ppo > loss_dual_bound, zero, 0.5 * d_ppo))
    grad = _where(negative, d_dual, d_ppo)
    grad = _where((log_ratio_raw >= -LOG_RATIO_CLAMP) & (log_ratio_raw <= LOG_RATIO_CLAMP), grad, zero)
    clipped = loss_clipped > loss_unclipped
    clipped_lower = (loss_ppo > loss_dual_bound) & negative
    return loss, grad, clipped, clipped_lower, -log_ratio


def _kl(log_prob: torch.Tensor, ref: torch.Tensor, kl_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(value, d value/d log_prob) of core_algos.kl_penalty(log_prob, ref, kl_type)."""
    straight_through = kl_type.endswith("+")  # value of the base estimator, gradient of k2
    base = kl_type[:-1] if straight_through else kl_type
    diff = log_prob - ref
    if base in ("kl", "k1"):
        value, grad = diff, torch.ones_like(diff)
    elif base == "abs":
        value, grad = diff.abs(), torch.sign(diff)
    elif base in ("mse", "k2"):
        value, grad = 0.5 * diff.square(), diff
    elif base in ("low_var_kl", "k3"):
        x = ref - log_prob
        k = x.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        estimate = torch.exp(k) - k - 1
        value = estimate.clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
        passes = ((x >= -K3_LOG_RATIO_CLAMP) & (x <= K3_LOG_RATIO_CLAMP)
                  & (estimate >= -K3_VALUE_CLAMP) & (estimate <= K3_VALUE_CLAMP))
        grad = _where(passes, 1.0 - torch.exp(k), torch.zeros_like(k))
    else:  # validate() admits only core_algos.KL_PENALTY_TYPES
        raise ValueError(f"unknown kl_loss_type {kl_type!r}")
    if straight_through:
        grad = diff
    return value, grad


def token_terms(spec: PPOTokenLoss, r0: int, r1: int, log_prob: torch.Tensor,
                entropy: torch.Tensor) -> TokenTerms:
    """Terms of tokens [r0, r1) from their log-probs and entropies (in the accumulation dtype)."""
    acc = log_prob.dtype

    def rows(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t[r0:r1].to(acc)  # a no-op after PPOTokenLoss.to(acc)

    adv, weights = rows(spec.advantages), rows(spec.weights)
    old = log_prob if spec.old_log_prob is None else rows(spec.old_log_prob)
    pg, d_pg, clipped, clipped_lower, neg_log_ratio = _vanilla(
        log_prob, old, adv, spec.clip_ratio_low, spec.clip_ratio_high, spec.clip_ratio_c)
    isw = rows(spec.rollout_is_weights)
    if isw is not None:
        pg, d_pg = pg * isw, d_pg * isw
    g_log_prob = d_pg
    kl = None
    if spec.kl_loss_coef != 0:
        kl, d_kl = _kl(log_prob, rows(spec.ref_log_prob), spec.kl_loss_type)
        g_log_prob = g_log_prob + spec.kl_loss_coef * d_kl
    g_entropy = None if spec.entropy_coeff == 0 else -spec.entropy_coeff * weights
    return TokenTerms(pg=pg, kl=kl, clipped=clipped, clipped_lower=clipped_lower, neg_log_ratio=neg_log_ratio,
                      g_log_prob=g_log_prob * weights, g_entropy=g_entropy)


def weighted_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w·v over tokens with w != 0 (agg_loss's masked_sum: a NaN/inf where the token is out of the loss
    does not leak in)."""
    return torch.where(weights != 0, values * weights, torch.zeros_like(values)).sum()


class TokenResults:
    """Per-token results of the whole input, filled chunk by chunk, reduced once at the end."""

    def __init__(self, n: int, acc: torch.dtype, device: torch.device, with_kl: bool):
        new = lambda: torch.zeros(n, dtype=acc, device=device)  # noqa: E731
        self.log_probs, self.entropy, self.pg = new(), new(), new()
        self.kl = new() if with_kl else None
        self.clipped, self.clipped_lower, self.neg_log_ratio = new(), new(), new()

    def store(self, r0: int, r1: int, log_probs, entropy, terms: TokenTerms) -> None:
        self.log_probs[r0:r1], self.entropy[r0:r1], self.pg[r0:r1] = log_probs, entropy, terms.pg
        if self.kl is not None:
            self.kl[r0:r1] = terms.kl
        self.clipped[r0:r1], self.clipped_lower[r0:r1] = terms.clipped, terms.clipped_lower
        self.neg_log_ratio[r0:r1] = terms.neg_log_ratio

    def finish(self, spec: PPOTokenLoss) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, stats [pg_loss, entropy_loss, kl_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower])."""
        acc = self.pg.dtype
        w, mask = spec.weights.to(acc), spec.mask.to(acc)
        pg_loss = weighted_sum(self.pg, w)
        entropy_loss = weighted_sum(self.entropy, w)
        kl_loss = weighted_sum(self.kl, w) if self.kl is not None else torch.zeros_like(pg_loss)
        loss = pg_loss
        if spec.entropy_coeff != 0:
            loss = loss - spec.entropy_coeff * entropy_loss
        if self.kl is not None:
            loss = loss + spec.kl_loss_coef * kl_loss
        tokens = mask.sum() + 1e-8  # veRL's masked_mean

        def masked_mean(values: torch.Tensor) -> torch.Tensor:
            return weighted_sum(values, mask) / tokens

        stats = torch.stack([pg_loss, entropy_loss, kl_loss, masked_mean(self.clipped),
                             masked_mean(self.neg_log_ratio), masked_mean(self.clipped_lower)])
        return loss, stats


def token_step(spec: PPOTokenLoss, results: TokenResults, r0: int, r1: int, m: torch.Tensor, s: torch.Tensor,
               u: torch.Tensor, label_logit: torch.Tensor, inv_temp: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """From the full-row statistics of rows [r0, r1): store their results and return (lse, entropy, g_lp, g_ent)
    with the gradient coefficients w.r.t. the UNSCALED logits (× 1/temperature). The Triton backend does the
    same in one launch (ppo_token_triton.token_step)."""
    log_probs, entropy, lse = row_stats.finalize(m, s, u, label_logit)
    terms = token_terms(spec, r0, r1, log_probs, entropy)
    results.store(r0, r1, log_probs, entropy, terms)
    g_ent = None if terms.g_entropy is None else terms.g_entropy * inv_temp
    return lse, entropy, terms.g_log_prob * inv_temp, g_ent
