"""Validation: generate on the validation set with `rollout.val_kwargs`, score, report `val/test_score/<source>`
(the trainer adds its wall time as `timing_s/testing`, veRL's name)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mppo.data import RLDataset
from mppo.data.loader import PromptBatch, collate
from mppo.trainer.rollout_batch import all_gather_rows

# (GLOBAL prompts, global index of the first) -> (this DP rank's responses' summed scores [rows], their data sources)
ScoreResponses = Callable[[PromptBatch, int], tuple[torch.Tensor, list[str]]]


def mean_scores(dataset: RLDataset, score: ScoreResponses, *, batch_size: int | None, pad_token_id: int, dp: int,
                dp_group: dist.ProcessGroup | None) -> dict[str, float]:
    """Mean score per data source over the whole validation set, in batches of `batch_size` prompts (None: all at
    once); every rank gets the same numbers. Collective over every rank (each call of `score` is)."""
    batch_size = batch_size or len(dataset)
    batch_size = max(dp, batch_size - batch_size % dp)  # every DP rank gets an equal share
    sources = sorted({dataset[i].data_source for i in range(len(dataset))})
    source_id = {s: i for i, s in enumerate(sources)}
    score_sum = torch.zeros(len(sources), dtype=torch.float64)
    count = torch.zeros(len(sources), dtype=torch.float64)
    usable = len(dataset) - len(dataset) % dp
    for start in range(0, usable, batch_size):
        prompts = collate([dataset[i] for i in range(start, min(start + batch_size, usable))], pad_token_id)
        scores, row_sources = score(prompts, start)
        ids = torch.tensor([source_id[s] for s in row_sources])
        score_sum += torch.zeros_like(score_sum).index_add_(0, ids, scores.double())
        count += torch.zeros_like(count).index_add_(0, ids, torch.ones_like(scores.double()))
    totals = all_gather_rows(torch.stack([score_sum, count]).unsqueeze(0), dp_group).sum(0)
    return {f"val/test_score/{s}": (totals[0, i] / totals[1, i].clamp(min=1)).item() for s, i in source_id.items()}
