"""DAPO's overlong reward shaping (https://arxiv.org/abs/2503.14476, "soft overlong punishment") and the
truncated-response test used to mask such responses out of the loss ("overlong filtering").

veRL 0.9.1's DAPO reward manager (`reward.reward_kwargs.overlong_buffer_cfg`, `reward.reward_kwargs.max_resp_len`):

    expected_len = max_resp_len - buffer_len
    penalty      = min(-(length - expected_len) / buffer_len * penalty_factor, 0)

added to each response's score: 0 up to `expected_len` tokens, then linearly down to -penalty_factor at
`max_resp_len` tokens. The score lives on the response's last valid token, so the penalty goes there too.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["overlong_penalty", "apply_overlong_penalty", "truncated_responses"]


def overlong_penalty(response_lengths: torch.Tensor, *, max_resp_len: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft length penalty per response (<= 0), float32, from the valid response lengths [B]."""
    if buffer_len <= 0 or buffer_len > max_resp_len:
        raise ValueError(f"overlong buffer len must be in 1..max_resp_len={max_resp_len}, got {buffer_len}")
    exceed = response_lengths.to(torch.float32) - (max_resp_len - buffer_len)
    return torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def apply_overlong_penalty(token_level_scores: torch.Tensor, response_mask: torch.Tensor, *, max_resp_len: int,
                           buffer_len: int, penalty_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores with each response's penalty added on its last valid token, the penalties [B]). Empty responses
    have nothing to penalise (their penalty is 0 for any buffer shorter than max_resp_len)."""
    lengths = response_mask.sum(dim=-1).long()
    penalty = overlong_penalty(lengths, max_resp_len=max_resp_len, buffer_len=buffer_len,
                               penalty_factor=penalty_factor)
    shaped = token_level_scores.clone()
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    shaped[rows, lengths[rows] - 1] += penalty[rows].to(shaped.dtype)
    return shaped, penalty


def truncated_responses(responses: torch.Tensor, response_mask: torch.Tensor, *, max_response_length: int,
                        stop_token_ids: Sequence[int]) -> torch.Tensor:
    """[B] bool: responses cut at the length limit (finish reason "length"): `max_response_length` tokens whose
    last is not a stop token. With no stop ids (rollout.ignore_eos) every full-length response counts."""
    lengths = response_mask.sum(dim=-1).long()
    full = lengths >= max_response_length
    last = responses.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    stopped = torch.isin(last, torch.tensor(list(stop_token_ids), dtype=last.dtype, device=last.device))
    return full & ~stopped
