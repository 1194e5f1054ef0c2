"""Backend-independent half of the fused PPO-clip loss (veRL 0.9.1 "vanilla"): validation, aggregation, autograd.

A backend's `row_pass(old, log_prob, advantages, mask, rollout_is_weights, clip_low, clip_high, clip_c, need_grad,
nan_safe_loss_sum)` makes ONE pass over the [bs, T] tokens and returns
  * stats [5, bs]: per row Σ_t of (loss·w_is, mask, clipped, −log_ratio, dual-clipped), each masked as
    veRL's masked_sum does (`where(m != 0, v, 0) · m`) — except the loss of the seq-mean modes
    (nan_safe_loss_sum=False), which veRL 0.9.1 sums as plain `Σ_t L·m`, so NaN under the mask propagates there;
  * grad [bs, T] or None: ∂(Σ_t masked loss)/∂log_prob per token.
Every aggregation mode is a per-row weighted sum of the row sums, loss = Σ_i w_i · S_i (seq-mean-token-mean
divides each row by its own token count first), so the gradient is w_i · grad — no second pass over the tokens.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
Number = float | int | torch.Tensor


def _given(value: Optional[Number]) -> bool:
    """veRL writes `x or default`: None and 0 both mean "not given"."""
    return value is not None and bool(value != 0)


def aggregate(row_loss: torch.Tensor, row_tokens: torch.Tensor, seq_len: int, loss_agg_mode: str, dp_size: int,
              batch_num_tokens: Optional[Number], global_batch_size: Optional[Number],
              loss_scale_factor: Optional[Number]) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-row gradient weight w_i) for the mode; the formulas are ppo_math.md §4 (agg_loss)."""
    if loss_agg_mode == "token-mean":
        if dp_size > 1 and batch_num_tokens is None:
            raise ValueError("loss_agg_mode='token-mean' with dp_size > 1 needs batch_num_tokens (the global count "
                             "of valid tokens) so every DP rank divides by the same number")
        denom = batch_num_tokens if _given(batch_num_tokens) else row_tokens.sum()
        loss = row_loss.sum() / denom * dp_size
        denom = torch.as_tensor(denom, dtype=row_loss.dtype, device=row_loss.device)
        return loss, (dp_size / denom).expand_as(row_loss)
    if loss_agg_mode == "token-sum":
        return row_loss.sum() * dp_size, torch.full_like(row_loss, float(dp_size))
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {AGG_MODES}")
    if dp_size > 1 and global_batch_size is None:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} with dp_size > 1 needs global_batch_size (the global "
                         f"number of sequences) so every DP rank divides by the same number")
    has_tokens = (row_tokens > 0).to(row_loss.dtype)  # fully masked rows are not sequences
    n_seq = global_batch_size if _given(global_batch_size) else has_tokens.sum()
    weight = has_tokens
    if loss_agg_mode == "seq-mean-token-mean":
        weight = has_tokens / (row_tokens + 1e-8)
    # where(): a fully masked row is left out even if its plain sum is NaN (veRL's masked_sum over rows)
    loss = torch.where(has_tokens > 0, row_loss * weight, torch.zeros_like(row_loss)).sum() / n_seq * dp_size
    row_weight = weight * dp_size / torch.as_tensor(n_seq, dtype=row_loss.dtype, device=row_loss.device)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        norm = loss_scale_factor if _given(loss_scale_factor) else seq_len
        loss, row_weight = loss / norm, row_weight / norm
    return loss, row_weight


class _AttachGrad(torch.autograd.Function):
    """Gives a precomputed loss value the precomputed gradient ∂loss/∂log_prob."""

    @staticmethod
    def forward(ctx, log_prob, loss, grad_log_prob):
        ctx.save_for_backward(grad_log_prob)
        ctx.dtype = log_prob.dtype
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        (grad_log_prob,) = ctx.saved_tensors
        return (g * grad_log_prob).to(ctx.dtype), None, None


def _validate(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, clip_ratio_c) -> None:
    shape = log_prob.shape
    if log_prob.dim() != 2:
        raise ValueError(f"log_prob must be [batch, response_len], got {tuple(shape)}")
    named = {"old_log_prob": old_log_prob, "advantages": advantages, "response_mask": response_mask,
             "rollout_is_weights": rollout_is_weights}
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like log_prob")
    if torch.is_grad_enabled():
        for name in ("old_log_prob", "advantages", "rollout_is_weights"):
            if named[name] is not None and named[name].requires_grad:
                raise ValueError(f"fused_ppo_loss differentiates only log_prob; {name} requires grad — detach it "
                                 f"(veRL treats it as data) or use core_algos.compute_policy_loss")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")


def fused_ppo_loss(backend: ModuleType, old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                   advantages: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, *,
                   clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float,
                   rollout_is_weights: Optional[torch.Tensor], dp_size: int, batch_num_tokens: Optional[Number],
                   global_batch_size: Optional[Number], loss_scale_factor: Optional[Number]
                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the fused loss with `backend`; see mppo.kernels.fused_ppo_loss for the contract."""
    _validate(old_log_prob, log_prob, advantages, response_mask, rollout_is_weights, clip_ratio_c)
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {AGG_MODES}")
    need_grad = torch.is_grad_enabled() and log_prob.requires_grad
    with torch.no_grad():
        stats, grad = backend.row_pass(old_log_prob, log_prob.detach(), advantages, response_mask,
                                       rollout_is_weights, clip_ratio_low, clip_ratio_high, clip_ratio_c, need_grad,
                                       nan_safe_loss_sum=loss_agg_mode.startswith("token"))
        row_loss, row_tokens, row_clipped, row_neg_kl, row_clipped_lower = stats
        loss, row_weight = aggregate(row_loss, row_tokens, log_prob.shape[-1], loss_agg_mode, dp_size,
                                     batch_num_tokens, global_batch_size, loss_scale_factor)
        tokens = row_tokens.sum() + 1e-8  # masked_mean's epsilon
        metric_values = (torch.stack([row_clipped.sum(), row_neg_kl.sum(), row_clipped_lower.sum()]) / tokens)
    clipfrac, ppo_kl, clipfrac_lower = metric_values.tolist()  # one device sync for all three
    metrics = {"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": clipfrac_lower}
    if need_grad:
        loss = _AttachGrad.apply(log_prob, loss, grad * row_weight.unsqueeze(1))
    return loss, metrics
