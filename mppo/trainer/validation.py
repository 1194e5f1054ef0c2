"""Validation: generate on the validation set with `rollout.val_kwargs`, score, report `val/test_score/<source>`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mppo.data import RLDataset
from mppo.data.loader import collate
from mppo.trainer.rollout_batch import all_gather_rows

if TYPE_CHECKING:
    from mppo.trainer.fit import PPOTrainer


def validate(trainer: "PPOTrainer", dataset: RLDataset) -> dict[str, float]:
    """Mean score per data source over the whole validation set (every rank gets the same numbers)."""
    cfg, io = trainer.cfg, trainer.io
    trainer.sync_weights()
    batch_size = cfg.data.val_batch_size or len(dataset)
    dp = trainer.dims.dp
    batch_size = max(dp, batch_size - batch_size % dp)  # every DP rank gets an equal share
    sources = sorted({dataset[i].data_source for i in range(len(dataset))})
    source_id = {s: i for i, s in enumerate(sources)}
    score_sum = torch.zeros(len(sources), dtype=torch.float64)
    count = torch.zeros(len(sources), dtype=torch.float64)
    pad = trainer.data.tokenizer.pad_token_id
    for start in range(0, len(dataset) - len(dataset) % dp, batch_size):
        items = [dataset[i] for i in range(start, min(start + batch_size, len(dataset) - len(dataset) % dp))]
        prompts = collate(items, pad)
        batch = trainer.generate(prompts, start, trainer.val_sampling, step=trainer.step)
        prompts, _ = io.dp_slice(prompts)
        n = trainer.val_sampling.n
        scores = batch["token_level_scores"].sum(-1).double()
        ids = torch.tensor([source_id[s] for s in prompts.data_sources for _ in range(n)])
        score_sum += torch.zeros_like(score_sum).index_add_(0, ids, scores)
        count += torch.zeros_like(count).index_add_(0, ids, torch.ones_like(scores))
    trainer.rollout.release()
    totals = all_gather_rows(torch.stack([score_sum, count]).unsqueeze(0), io.dp_group).sum(0)
    return {f"val/test_score/{s}": (totals[0, i] / totals[1, i].clamp(min=1)).item() for s, i in source_id.items()}
