"""Loss aggregation over a global batch (veRL 0.9.1 `agg_loss`).

A micro-batch loss is a *partial sum* of the global-batch loss when the global batch facts are passed in
(`GlobalBatchInfo`): the sum over micro-batches of a rank, averaged over the DP ranks (as DDP averages
gradients), equals the loss of the whole global batch, whatever the split. That is why every mode multiplies
by `dp_size` and divides by a *global* count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .masked import masked_sum

__all__ = ["AGG_LOSS_MODES", "GlobalBatchInfo", "agg_loss", "agg_token_weights"]

AGG_LOSS_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


@dataclass(frozen=True)
class GlobalBatchInfo:
    """Facts about the global batch a micro-batch belongs to (veRL's `config.global_batch_info`)."""

    dp_size: int = 1  # data-parallel world size; >1 requires the global counts below
    batch_num_tokens: int | torch.Tensor | None = None  # valid (mask != 0) tokens in the global batch
    global_batch_size: int | torch.Tensor | None = None  # sequences with >= 1 valid token in the global batch
    loss_scale_factor: float | None = None  # divisor of "seq-mean-token-sum-norm"; None = padded length T

    def as_kwargs(self) -> dict:
        """The fields as keyword arguments for `agg_loss` (no copies: `dataclasses.asdict` would deep-copy tensors)."""
        return {
            "dp_size": self.dp_size,
            "batch_num_tokens": self.batch_num_tokens,
            "global_batch_size": self.global_batch_size,
            "loss_scale_factor": self.loss_scale_factor,
        }


def _global_tokens(loss_mask: torch.Tensor, batch_num_tokens, dp_size: int, caller: str):
    """batch_num_tokens, or the local count when it is not given (only valid without DP)."""
    if batch_num_tokens is None:
        if dp_size > 1:
            raise ValueError(
                f"{caller}('token-mean'): dp_size > 1 needs batch_num_tokens, the number of valid tokens in the "
                "global batch; a per-rank count would weight ranks unequally."
            )
        batch_num_tokens = loss_mask.sum()
    return batch_num_tokens


def _global_seqs(seq_has_tokens: torch.Tensor, global_batch_size, dp_size: int, caller: str, mode: str):
    """global_batch_size, or the local count of non-empty sequences when it is not given (only valid without DP)."""
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(
                f"{caller}({mode!r}): dp_size > 1 needs global_batch_size, the number of sequences "
                "with at least one valid token in the global batch."
            )
        global_batch_size = seq_has_tokens.sum()
    return global_batch_size


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a `(bs, T)` loss matrix into a scalar.

    Modes (`m` = loss_mask, `has_i` = [row i has a valid token], `G` = global_batch_size or sum_i has_i):
      * "token-mean":  masked_sum(L, m) / (batch_num_tokens or m.sum()) * dp_size
      * "token-sum":   masked_sum(L, m) * dp_size
      * "seq-mean-token-sum":      sum_i has_i * sum_t(L*m) / G * dp_size
      * "seq-mean-token-sum-norm": the above / (loss_scale_factor or T)
      * "seq-mean-token-mean":     sum_i has_i * sum_t(L*m) / (sum_t m + 1e-8) / G * dp_size

    veRL 0.9.1 quirks kept (older veRL differed):
      * "token-mean" has no epsilon: an all-masked micro-batch without `batch_num_tokens` gives NaN.
      * fully-masked rows are excluded from the seq-mean denominator G (older veRL used torch.mean over all rows).
      * "seq-mean-token-sum-norm" divides by the *padded* length `loss_mask.shape[-1]` unless `loss_scale_factor`
        is set, so its value depends on padding.
      * the seq modes use a plain `sum(L * m)` (NaN outside the mask propagates), token modes use `masked_sum`.

    Raises ValueError for an unknown mode, and when `dp_size > 1` comes without the global count the mode needs
    (`batch_num_tokens` for token-mean, `global_batch_size` for the seq modes).
    """
    if loss_agg_mode == "token-mean":
        batch_num_tokens = _global_tokens(loss_mask, batch_num_tokens, dp_size, "agg_loss")
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_seq = torch.sum(loss_mask, dim=-1)
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens_per_seq + 1e-8)
        seq_has_tokens = (tokens_per_seq > 0).float()
        global_batch_size = _global_seqs(seq_has_tokens, global_batch_size, dp_size, "agg_loss", loss_agg_mode)
        loss = masked_sum(seq_losses, seq_has_tokens) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {list(AGG_LOSS_MODES)}.")


def agg_token_weights(
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | torch.Tensor | None = None,
    global_batch_size: int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Per-token weights `w` [bs, T] with `agg_loss(L, loss_mask, mode, ...) == sum(L * w)` for every finite L.

    Every mode is linear in the token losses, with weights fixed by the mask and the global batch facts:
    token-mean `m * dp / N_tokens`, token-sum `m * dp`, seq-mean-token-sum `m * dp / G`, seq-mean-token-mean
    `m / (sum_t m + 1e-8) * dp / G`, seq-mean-token-sum-norm `m * dp / G / (loss_scale_factor or T)` (rows
    without a valid token have weight 0). A fused kernel that needs d(loss)/d(token loss) before the loss is
    aggregated uses these. Same arguments and errors as `agg_loss`.
    """
    mask = loss_mask.to(torch.promote_types(loss_mask.dtype, torch.float32))
    valid = torch.where(mask != 0, mask, torch.zeros_like(mask))  # masked_sum's where(m != 0) * m
    if loss_agg_mode == "token-mean":
        batch_num_tokens = _global_tokens(mask, batch_num_tokens, dp_size, "agg_token_weights")
        return valid * (dp_size / batch_num_tokens)
    if loss_agg_mode == "token-sum":
        return valid * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_seq = torch.sum(mask, dim=-1, keepdim=True)
        seq_has_tokens = (tokens_per_seq > 0).to(mask.dtype)
        global_batch_size = _global_seqs(seq_has_tokens, global_batch_size, dp_size, "agg_token_weights",
                                         loss_agg_mode)
        weights = mask * seq_has_tokens * (dp_size / global_batch_size)
        if loss_agg_mode == "seq-mean-token-mean":
            weights = weights / (tokens_per_seq + 1e-8)
        if loss_agg_mode == "seq-mean-token-sum-norm":
            weights = weights / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return weights
    raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {list(AGG_LOSS_MODES)}.")
