"""Outcome-reward advantage estimators that compare responses to the same prompt (veRL 0.9.1 semantics).

Shared conventions (veRL quirks kept, see ppo_math.md section 7):
  * the score of a response is the sum of its **whole** row of `token_level_rewards` (the mask is not applied
    before the sum);
  * rows are grouped by equality of `index[i]` (uids; groups need not be contiguous), groups in order of first
    appearance;
  * a singleton group uses mean 0 (and std 1): veRL builds these as float32 0-d tensors, and the arithmetic
    here keeps that dtype promotion, so float64 or half-precision rewards give veRL's exact bits too;
  * std is `torch.std`, i.e. **unbiased** (ddof = 1), and the epsilon is added to the std, not the variance;
  * the scalar advantage is broadcast over the row and multiplied by the mask (masked positions exactly 0),
    and `returns` is the same tensor as `advantages`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .adv_registry import register_adv_est
from .masked import masked_whiten

__all__ = [
    "group_rows",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
]

GroupIndex = Sequence[Any] | np.ndarray | torch.Tensor


def group_rows(index: GroupIndex, batch_size: int) -> dict[Any, list[int]]:
    """Map each group id to the rows carrying it, in order of first appearance.

    `index` is any sequence of hashable ids (numpy object array of uid strings, list, ...). A torch tensor is
    read through `.tolist()` (0-d tensors hash by identity, which would make every row its own group).
    """
    if isinstance(index, torch.Tensor):
        index = index.reshape(-1).tolist()
    if len(index) != batch_size:
        raise ValueError(f"index has {len(index)} group ids but the batch has {batch_size} rows; pass one per row.")
    groups: dict[Any, list[int]] = {}
    for row in range(batch_size):
        groups.setdefault(index[row], []).append(row)
    return groups


def _zero(scores: torch.Tensor) -> torch.Tensor:
    # veRL's singleton-group mean: torch.tensor(0.0), a float32 0-d tensor.
    return torch.tensor(0.0, device=scores.device)


def _one(scores: torch.Tensor) -> torch.Tensor:
    # veRL's singleton-group std: torch.tensor(1.0), a float32 0-d tensor.
    return torch.tensor(1.0, device=scores.device)


@register_adv_est("grpo", needs=("index",), params=("norm_adv_by_std_in_grpo",))
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: `a_i = (s_i - mean_g) / (std_g + epsilon)`, or `s_i - mean_g` when `norm_adv_by_std_in_grpo` is
    False (Dr.GRPO, https://arxiv.org/abs/2503.20783). Unbiased std; a singleton group gives `s / (1 + eps)`;
    an all-equal group gives exactly 0. veRL's trainer always calls it with the default epsilon 1e-6."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            if len(rows) == 1:
                s = scores[rows[0]]
                adv[rows[0]] = (s - _zero(s)) / (_one(s) + epsilon) if norm_adv_by_std_in_grpo else s - _zero(s)
                continue
            group = scores[rows]
            mean, std = torch.mean(group), torch.std(group)
            adv[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("grpo_vectorized", needs=("index",), params=("norm_adv_by_std_in_grpo",))
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorized GRPO: the same advantages as "grpo" up to float32 rounding. Group statistics are computed in
    float32 with `index_add_` sums: mean = sum / n, std = sqrt(max(sum (s - mean)^2 / max(n - 1, 1), 0)),
    singleton mean 0 / std 1 (veRL's `group_mean_std(eps=0)`)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        group_of_row = torch.empty(scores.shape[0], dtype=torch.long)
        for group, rows in enumerate(group_rows(index, scores.shape[0]).values()):
            group_of_row[rows] = group
        group_of_row = group_of_row.to(scores.device)
        num_groups = int(group_of_row.max().item()) + 1 if group_of_row.numel() else 0
        s32 = scores.to(torch.float32)
        zeros = torch.zeros(num_groups, device=scores.device, dtype=torch.float32)
        count = zeros.clone().index_add_(0, group_of_row, torch.ones_like(s32))
        mean = zeros.clone().index_add_(0, group_of_row, s32) / count.clamp_min(1.0)
        centered = s32 - mean[group_of_row]
        var = zeros.clone().index_add_(0, group_of_row, centered * centered) / (count - 1.0).clamp_min(1.0)
        std = torch.sqrt(torch.clamp(var, min=0.0))
        singleton = count <= 1.0
        mean[singleton], std[singleton] = 0.0, 1.0
        if norm_adv_by_std_in_grpo:
            adv = (scores - mean[group_of_row]) / (std[group_of_row] + epsilon)
        else:
            adv = scores - mean[group_of_row]
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("rloo", needs=("index",))
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: GroupIndex, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (https://arxiv.org/abs/2402.14740): for n > 1, `a_i = s_i * n/(n-1) - mean * n/(n-1)` (= s_i minus
    the mean of the other responses). veRL quirk: a singleton keeps its raw score `a_i = s_i` (the vectorized
    variant "rloo_vectorized" gives 0 there instead). `epsilon` is unused (veRL signature)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            n = len(rows)
            if n > 1:
                group = scores[rows]
                mean = torch.mean(group)
                adv[rows] = group * n / (n - 1) - mean * n / (n - 1)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("rloo_vectorized", needs=("index",))
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: GroupIndex, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorized RLOO: `(n * s_i - sum_g) / max(n - 1, 1) * [n > 1]`. veRL quirk: unlike "rloo", a singleton
    gets advantage 0. Groups come from `np.unique(index)`, so ids must be mutually comparable."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        ids = index.reshape(-1).tolist() if isinstance(index, torch.Tensor) else index
        if len(ids) != scores.shape[0]:
            raise ValueError(f"index has {len(ids)} group ids but the batch has {scores.shape[0]} rows.")
        inverse = torch.from_numpy(np.unique(np.asarray(ids), return_inverse=True)[1].reshape(-1)).to(scores.device)
        count = torch.bincount(inverse)[inverse].to(scores.dtype)
        group_sum = torch.bincount(inverse, weights=scores)[inverse]
        adv = ((count * scores - group_sum) / (count - 1).clamp_min(1)) * (count > 1)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("reinforce_plus_plus_baseline", needs=("index",))
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: GroupIndex, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (https://arxiv.org/abs/2501.03262): `s_i - mean_g` (singleton: mean 0, no std),
    tiled over the row and masked, then whitened **batch-wide** (`masked_whiten(., m) * m`, unbiased variance).
    `epsilon` is unused (veRL signature)."""
    with torch.no_grad():
        response_length = token_level_rewards.shape[-1]
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            if len(rows) == 1:
                s = scores[rows[0]]
                adv[rows[0]] = s - _zero(s)
                continue
            group = scores[rows]
            adv[rows] = group - torch.mean(group)
        adv = adv.unsqueeze(-1).tile([1, response_length]) * response_mask
        adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


@register_adv_est("opo", needs=("index",))
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: GroupIndex, epsilon: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (https://arxiv.org/abs/2505.23585): length-weighted baseline `b_g = sum_j len_j s_j / sum_j len_j`
    with `len = mask.sum(-1)`; a singleton's baseline is 0. `a_i = s_i - b_g`, times the mask.
    `epsilon` is unused (veRL signature)."""
    with torch.no_grad():
        lengths = response_mask.sum(dim=-1)
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in group_rows(index, scores.shape[0]).values():
            if len(rows) == 1:
                s = scores[rows[0]]
                adv[rows[0]] = s - _zero(s)
                continue
            group, group_lengths = scores[rows], lengths[rows]
            baseline = (group_lengths * group).sum() / group_lengths.sum()
            # veRL subtracts 0-d tensors, so the score and the baseline (dtype of lengths * scores) promote together.
            common = torch.promote_types(group.dtype, baseline.dtype)
            adv[rows] = (group.to(common) - baseline.to(common)).to(adv.dtype)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("gpg", needs=("index",))
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (https://arxiv.org/abs/2504.02546): `a_i = alpha * (s_i - mean_g) / f_norm` (singleton mean 0).

    veRL quirk kept: the `alpha` argument is ignored and recomputed as `bs / max(count_nonzero(scores), 1)`
    (a float32 0-d tensor), which rescales for responses with zero reward. No std normalisation.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        batch_size = scores.shape[0]
        alpha = batch_size / torch.count_nonzero(scores).clamp(min=1)  # overrides the argument, as veRL does
        adv = scores.clone()
        for rows in group_rows(index, batch_size).values():
            if len(rows) == 1:
                s = scores[rows[0]]
                adv[rows[0]] = alpha * (s - _zero(s)) / f_norm
                continue
            group = scores[rows]
            centered = group - torch.mean(group)
            # veRL multiplies 0-d tensors, so alpha (float32) and the score promote together; keep that dtype.
            common = torch.promote_types(alpha.dtype, centered.dtype)
            adv[rows] = (alpha.to(common) * centered.to(common) / f_norm).to(adv.dtype)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("grpo_passk", needs=("index",), params=("norm_adv_by_std_in_grpo",))
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (https://arxiv.org/abs/2503.19595): only the best response of each group gets a non-zero
    advantage, `r_max - r_second` (divided by `unbiased std + epsilon` when normalising); everything else is 0.

    Every group needs at least 2 responses (ValueError otherwise). veRL quirk: veRL reads the normalisation
    flag from `config["norm_adv_by_std_in_grpo"]` (default True) and ignores the keyword argument; when a
    `config` mapping is passed here the same happens. Without `config` the keyword is used (veRL requires a
    config; the dispatcher passes `algorithm.norm_adv_by_std_in_grpo` as the keyword).
    """
    if config is not None:
        norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", True)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.zeros_like(scores)
        for group_id, rows in group_rows(index, scores.shape[0]).items():
            if len(rows) < 2:
                raise ValueError(
                    f"grpo_passk needs at least 2 responses per prompt; group {group_id!r} has {len(rows)}. "
                    "Set actor_rollout_ref.rollout.n >= 2."
                )
            group = scores[rows]
            top, top_idx = torch.topk(group, 2)
            best = top[0] - top[1]
            if norm_adv_by_std_in_grpo:
                best = best / (torch.std(group) + epsilon)
            adv[rows[int(top_idx[0].item())]] = best
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv
