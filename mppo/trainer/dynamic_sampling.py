"""DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476), veRL's `algorithm.filter_groups`.

A group (the n responses of one prompt) whose responses all have the same `metric` value carries no signal for a
group-relative advantage: it is dropped, and more generation batches of `data.gen_batch_size` prompts are
generated until `data.train_batch_size` groups are kept (then trimmed to exactly that many, in generation
order, as veRL's `batch[:traj_bsz]`). Singleton groups are kept (veRL: `std > 0 or len == 1`).

At `max_num_gen_batches` (> 0) generation batches the step goes on with what it has: veRL's DAPO recipe raises
there; here the missing groups are filled with filtered (uniform) groups in generation order - with a group
baseline their advantages are 0 - so the batch keeps its shape, with one warning and the metric
`train/filter_groups/filled_groups`.

Every rank runs this (SPMD): each DP rank generates its share of a generation batch, the rows are gathered over
DP so all ranks decide on the same global batch, and each takes its contiguous share back at the end. Generation
batch k of a step samples with prompt offsets shifted by k * gen_batch_size (distinct random streams, a function
of (step, k) only: resume is exact), and its group ids are shifted by k * dataset size (a prompt seen again
after an epoch boundary within one step is another group).

`metric` (veRL's names; its DAPO recipe and 0.9.1's trainer) is the per-response value compared:
- `reward`, `seq_reward`: the summed token-level score (DAPO's overlong penalty included), before any KL;
- `seq_final_reward`: the summed token-level reward after the in-reward KL penalty. Groups are filtered before
  the reference log-probs exist (only kept groups get them), so validation allows it only without
  algorithm.use_kl_in_reward, where it equals `seq_reward` (veRL's recipe computes the penalty before filtering
  from a reference log-prob it has not computed yet, and fails);
- `acc`, `score`: that key of the reward function's extra info (mppo.rewards.manager: a number it returns is
  `acc`, a dict return gives its numeric keys), before the overlong penalty. A response whose function did not
  return the key stops the run with FilterMetricError, on every rank alike.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mppo.config import MppoConfig
from mppo.data.loader import PromptBatch
from mppo.errors import UserError
from mppo.trainer.parallel_io import ModelParallelIO
from mppo.trainer.rollout_batch import all_gather_rows, local_rows
from mppo.workers.batch_schema import BATCH, FILTER_METRIC

log = logging.getLogger("mppo")

# Rollout tensors whose second dimension is the (left-padded) prompt plus the response, or the prompt alone.
_PROMPT_PADDED = tuple(k for k, key in BATCH.items() if key.shape in ("[B, P+T]", "[B, P]"))
EXTRA_INFO_METRICS = ("acc", "score")


class FilterMetricError(UserError, RuntimeError):
    """algorithm.filter_groups.metric names a reward extra info key the reward function did not return."""


def reward_extra_key(cfg: MppoConfig) -> str | None:
    """The reward extra info key dynamic sampling compares (None: it compares the summed scores, or is off)."""
    fg = cfg.algorithm.filter_groups
    return fg.metric if fg.enable and fg.metric in EXTRA_INFO_METRICS else None


def metric_values(metric: str, batch: dict[str, torch.Tensor], reward_name: str = "the reward function"
                  ) -> torch.Tensor:
    """[B] the value each response's group is compared on (see the module docstring)."""
    if metric not in EXTRA_INFO_METRICS:  # reward, seq_reward; seq_final_reward (validated: no KL in the reward)
        return batch["token_level_scores"].sum(dim=-1)
    values = batch[FILTER_METRIC]
    missing = int(torch.isnan(values).sum())
    if missing:
        raise FilterMetricError(
            f"algorithm.filter_groups.metric={metric}: {reward_name} returned no {metric!r} for {missing} of "
            f"{values.numel()} responses (a number it returns counts as 'acc'; a dict return gives its numeric "
            f"keys); return a dict with {metric!r} from it (veRL's form: {{'score': ..., 'acc': ...}}), or set "
            "algorithm.filter_groups.metric=reward (the summed score)")
    return values


def group_verdicts(metric: torch.Tensor, uid: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """(kept groups, filtered groups), each a list of row lists in order of first appearance. A group is
    filtered when it has more than one row and all its metric values are equal."""
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(uid.tolist()):
        groups.setdefault(group, []).append(row)
    kept, filtered = [], []
    for rows in groups.values():
        values = metric[rows]
        (filtered if len(rows) > 1 and bool((values == values[0]).all()) else kept).append(rows)
    return kept, filtered


def _left_pad_prompts(batch: dict[str, torch.Tensor], width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """The batch with its prompt part left-padded to `width` columns (padding: pad id, mask 0, position 0)."""
    extra = width - batch["prompt_mask"].shape[1]
    if extra == 0:
        return batch
    out = dict(batch)
    for key in _PROMPT_PADDED:
        fill = pad_token_id if key == "input_ids" else 0
        pad = torch.full((batch[key].shape[0], extra), fill, dtype=batch[key].dtype)
        out[key] = torch.cat([pad, batch[key]], dim=1)
    return out


def _concat(parts: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    width = max(p["prompt_mask"].shape[1] for p in parts)
    parts = [_left_pad_prompts(p, width, pad_token_id) for p in parts]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# (GLOBAL prompts of a generation batch, global index of its first prompt) -> this DP rank's rows, rolled out and
# rewarded (token_level_scores, reward_errors; FILTER_METRIC when the metric is acc or score)
GenerationBatch = Callable[[PromptBatch, int], dict[str, torch.Tensor]]


class DynamicSampler:
    """Collects one step's training batch from as many generation batches as `algorithm.filter_groups` needs."""

    def __init__(self, cfg: MppoConfig, io: ModelParallelIO, *, dataset_size: int, n: int, pad_token_id: int,
                 generation_batch: GenerationBatch, reward_name: str = "the reward function") -> None:
        self.io = io
        self.metric, self.reward_name = cfg.algorithm.filter_groups.metric, reward_name
        self.n = n
        self.pad_token_id = pad_token_id
        self.generation_batch = generation_batch
        self.train_groups = cfg.data.train_batch_size
        self.gen_batch_size = cfg.data.gen_batch_size or cfg.data.train_batch_size
        self.max_gen_batches = cfg.algorithm.filter_groups.max_num_gen_batches
        self.dataset_size = dataset_size

    def collect(self, batch: dict[str, torch.Tensor], more_prompts: Callable[[], PromptBatch] | None, *, step: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """This rank's share of step `step`'s rollout batch (exactly train_batch_size groups), starting from `batch`
        (generation batch 0, rolled out and rewarded), and the metrics."""
        io = self.io
        kept_parts, filtered_parts, num_kept, num_filtered, errors, gen = [], [], 0, 0, 0.0, 0
        while True:
            errors += float(all_gather_rows(batch.pop("reward_errors"), io.dp_group).sum())
            batch["uid"] = batch["uid"] + gen * self.dataset_size
            full = {k: all_gather_rows(v.cpu(), io.dp_group) for k, v in batch.items()}
            kept, filtered = group_verdicts(metric_values(self.metric, full, self.reward_name), full["uid"])
            gen += 1
            num_kept, num_filtered = num_kept + len(kept), num_filtered + len(filtered)
            for groups, parts in ((kept, kept_parts), (filtered, filtered_parts)):
                if groups:
                    rows = torch.tensor([r for g in groups for r in g])
                    parts.append({k: v[rows] for k, v in full.items()})
            if num_kept >= self.train_groups or more_prompts is None:
                break
            if 0 < self.max_gen_batches <= gen:
                break
            batch = self.generation_batch(more_prompts(), gen * self.gen_batch_size)
        filled = max(0, self.train_groups - num_kept)
        if filled:
            log.warning("step %d: %d of %d groups kept after %d generation batches (algorithm.filter_groups."
                        "max_num_gen_batches=%d); %d filtered groups fill the batch", step, num_kept,
                        self.train_groups, gen, self.max_gen_batches, filled)
        full = _concat(kept_parts + filtered_parts, self.pad_token_id)
        full = {k: v[:self.train_groups * self.n] for k, v in full.items()}
        local_batch = {k: local_rows(v, io.dp_group) for k, v in full.items() if k != FILTER_METRIC}
        local_batch["reward_errors"] = torch.tensor([errors if io.dims.dp_rank == 0 else 0.0])
        metrics = {"train/num_gen_batches": float(gen), "train/filter_groups/kept_groups": float(num_kept),
                   "train/filter_groups/filtered_groups": float(num_filtered),
                   "train/filter_groups/filled_groups": float(filled)}
        return local_batch, metrics
