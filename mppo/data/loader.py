"""Batches of prompts: left-padded collation and a seeded, resumable loader.

The loader's state is (epoch, position): the epoch's shuffle is a pure function of (seed, epoch), and position
counts the batches of that epoch already handed out. A checkpoint taken after a step stores the state; a loader
restored from it hands out exactly the batches an uninterrupted run would have.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from mppo.data.dataset import PromptItem


@dataclass
class PromptBatch:
    input_ids: torch.Tensor  # [B, L] int64, left-padded so every prompt ends at column L-1
    attention_mask: torch.Tensor  # [B, L] int64, 1 on prompt tokens
    position_ids: torch.Tensor  # [B, L] int64, 0 at each prompt's first token (0 on padding too)
    raw_prompts: list[str]
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict[str, Any]]
    indices: torch.Tensor  # [B] int64, each prompt's dataset index

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, rows: slice) -> "PromptBatch":
        """The prompts of `rows` (a slice), every field sliced alike."""
        if not isinstance(rows, slice):
            raise TypeError(f"a PromptBatch is sliced by a slice, not {type(rows).__name__}")
        return PromptBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def repeat(self, n: int) -> "PromptBatch":
        """Each prompt `n` times in a row (prompt-major, as engines return the n responses of each prompt)."""
        return PromptBatch(**{f.name: _repeat_rows(getattr(self, f.name), n) for f in fields(self)})


def _repeat_rows(rows: torch.Tensor | list, n: int) -> torch.Tensor | list:
    if isinstance(rows, torch.Tensor):
        return rows.repeat_interleave(n, dim=0)
    return [row for row in rows for _ in range(n)]


def collate(items: Sequence[PromptItem], pad_token_id: int, pad_to_length: int | None = None) -> PromptBatch:
    """Left-pad the prompts to the longest one (or to `pad_to_length`, for fixed shapes)."""
    if not items:
        raise ValueError("cannot collate an empty list of prompts")
    longest = max(len(item.input_ids) for item in items)
    length = longest if pad_to_length is None else pad_to_length
    if length < longest:
        raise ValueError(f"pad_to_length={pad_to_length} is shorter than the longest prompt ({longest} tokens)")
    input_ids = torch.full((len(items), length), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(items), length), dtype=torch.int64)
    for row, item in enumerate(items):
        n = len(item.input_ids)
        if n:
            input_ids[row, length - n:] = torch.tensor(item.input_ids, dtype=torch.int64)
            attention_mask[row, length - n:] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    return PromptBatch(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       raw_prompts=[item.raw_prompt for item in items],
                       data_sources=[item.data_source for item in items],
                       ground_truths=[item.ground_truth for item in items],
                       extra_infos=[item.extra_info for item in items],
                       indices=torch.tensor([item.index for item in items], dtype=torch.int64))


class PromptLoader:
    """Iterating yields the rest of the current epoch's batches, then moves to the next epoch:

        for epoch in range(loader.epoch, total_epochs):
            for batch in loader: ...

    drop_last (the default, as for training) keeps every batch exactly `batch_size` prompts.
    """

    def __init__(self, dataset: Sequence[PromptItem], batch_size: int, *, pad_token_id: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = True, pad_to_length: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}; "
                             "lower data.train_batch_size or make more data")
        self.dataset = dataset
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad_to_length = pad_to_length
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def __iter__(self) -> Iterator[PromptBatch]:
        order = self._order(self.epoch)
        while self.position < len(self):
            chunk = order[self.position * self.batch_size:(self.position + 1) * self.batch_size]
            batch = collate([self.dataset[int(i)] for i in chunk], self.pad_token_id, self.pad_to_length)
            self.position += 1  # counted before the yield: the state always says what was handed out
            yield batch
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "batch_size": self.batch_size,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a state; refuse one whose data, seed or batch size differ (the order would not continue)."""
        for key, now in (("dataset_size", len(self.dataset)), ("seed", self.seed), ("batch_size", self.batch_size)):
            if key in state and int(state[key]) != now:
                raise ValueError(f"the data loader state was saved with {key}={state[key]} but this run has "
                                 f"{key}={now}; resuming would not continue the same order of prompts. Use the "
                                 "original data and settings, or start a new run directory")
        if not 0 <= int(state["position"]) <= len(self):
            raise ValueError(f"data loader position {state['position']} is outside 0..{len(self)}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
