"""The trainer's uses of mppo.rewards.overlong: DAPO's soft overlong penalty on the training scores
(`reward.reward_kwargs.overlong_buffer_cfg`) and overlong filtering (`algorithm.mask_truncated_responses`).

The penalty shapes training rollouts only, right after scoring (so dynamic sampling filters on the shaped score,
as veRL's DAPO reward manager returns it); validation scores stay the task's own. Overlong filtering removes the
responses cut at the length limit from the response mask on the gathered global batch, before the advantages, so
they are in no loss, KL or entropy term; the response-length metrics still count them (UNREJECTED_MASK). When
every response of a step was cut, none is masked (with a warning): the loss would have no token at all.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mppo.config import MppoConfig
from mppo.rewards.overlong import apply_overlong_penalty, overlong_penalty, truncated_responses
from mppo.workers.batch_schema import UNREJECTED_MASK

log = logging.getLogger("mppo")


def _buffer_kwargs(cfg: MppoConfig) -> dict:
    kw = cfg.reward.reward_kwargs
    return {"max_resp_len": kw.max_resp_len, "buffer_len": kw.overlong_buffer_cfg.len,
            "penalty_factor": kw.overlong_buffer_cfg.penalty_factor}


def shape_scores(cfg: MppoConfig, batch: dict[str, torch.Tensor]) -> None:
    """Add the overlong penalty to `batch["token_level_scores"]` in place (when enabled)."""
    if cfg.reward.reward_kwargs.overlong_buffer_cfg.enable:
        batch["token_level_scores"], _ = apply_overlong_penalty(batch["token_level_scores"], batch["response_mask"],
                                                                **_buffer_kwargs(cfg))


def mask_truncated(cfg: MppoConfig, full: dict[str, torch.Tensor], stop_token_ids: Sequence[int]
                   ) -> tuple[dict[str, float], tuple[str, ...]]:
    """Overlong filtering on the global batch `full` (when enabled): (metrics, the keys of `full` changed)."""
    if not cfg.algorithm.mask_truncated_responses:
        return {}, ()
    truncated = truncated_responses(full["responses"], full["response_mask"],
                                    max_response_length=cfg.data.max_response_length, stop_token_ids=stop_token_ids)
    if bool(truncated.all()):
        # Nothing would be left in the loss (0 / 0 tokens: a non-finite update, counted as skipped); train on
        # them as without the option rather than stall the run.
        log.warning("all %d responses were cut at data.max_response_length=%d: none masked this step "
                    "(algorithm.mask_truncated_responses)", truncated.numel(), cfg.data.max_response_length)
        return {"response_length/masked_truncated": 0.0}, ()
    full.setdefault(UNREJECTED_MASK, full["response_mask"])
    full["response_mask"] = full["response_mask"] * (~truncated).to(full["response_mask"].dtype)[:, None]
    return {"response_length/masked_truncated": float(truncated.sum())}, ("response_mask",)


def overlong_metrics(cfg: MppoConfig, full: dict[str, torch.Tensor]) -> dict[str, float]:
    """reward/overlong_penalty/mean and reward/overlong_ratio (share of penalised responses), when logged."""
    buffer = cfg.reward.reward_kwargs.overlong_buffer_cfg
    if not (buffer.enable and buffer.log):
        return {}
    lengths = full.get(UNREJECTED_MASK, full["response_mask"]).sum(dim=-1)
    penalty = overlong_penalty(lengths, **_buffer_kwargs(cfg))
    return {"reward/overlong_penalty/mean": float(penalty.mean()),
            "reward/overlong_ratio": float((penalty < 0).float().mean())}
