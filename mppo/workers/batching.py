"""The workers' data contract (a veRL DataProto-like dict of tensors per DP rank) and how it is cut into
mini-batches and micro-batches for megatron's pipeline schedules.

Batch layout (B rows, P prompt columns, T response columns; mppo.workers.batch_schema declares every key):
  input_ids, attention_mask, position_ids  [B, P+T]  left-padded prompt ++ right-padded response
  responses, response_mask                 [B, T]    responses == input_ids[:, P:]
  update inputs, all [B, T] (UPDATE_KEYS): old_log_probs, advantages (actor); values, returns (critic);
  ref_log_prob, rollout_is_weights (optional).
  routed_experts [B, P+T, MoE layers, top_k] (optional): the rollout engine's experts of each token, which the
  actor replays (mppo.workers.router_replay); compacted into micro-batches like input_ids.
Log-probs and values are about the T response columns only.

megatron's rotary embedding uses positions 0..s-1 and its attention is causal only, so a micro-batch is
*compacted*: each row's attended tokens move to the front (right padding only). That equals veRL's
`position_ids = cumsum(attention_mask) - 1`, which `validate_batch` checks. Response token j of a row then sits
at compacted column c, and its log-prob / value comes from the output at column c - 1 (`response_index`).
Each micro-batch is as long as its longest row, so padding costs only within a micro-batch; with a token budget
(`use_dynamic_bsz`) rows are sorted by length first, so rows of similar length share micro-batches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from mppo.core_algos import GlobalBatchInfo
from mppo.workers.batch_schema import BATCH, ROUTES_KEY, read_by

Batch = Mapping[str, torch.Tensor]

# What every worker pass needs (mppo.workers.batch_schema declares each key): [B, P+T] and [B, T] tensors
_REQUIRED = tuple(k for k in read_by("workers") if BATCH[k].when == "always")
SEQUENCE_KEYS = tuple(k for k in _REQUIRED if BATCH[k].shape == "[B, P+T]")
RESPONSE_KEYS = tuple(k for k in _REQUIRED if BATCH[k].shape == "[B, T]")
# Optional [B, T] inputs of the updates, carried into micro-batches when present.
UPDATE_KEYS = read_by("update")


class BatchError(ValueError):
    """A batch that does not follow the workers' data contract."""


def validate_batch(batch: Batch, required: Sequence[str] = ()) -> tuple[int, int]:
    """Check the data contract; return (B, T). `required` names extra [B, T] keys the caller needs."""
    missing = [k for k in (*SEQUENCE_KEYS, *RESPONSE_KEYS, *required) if k not in batch]
    if missing:
        raise BatchError(f"batch is missing {missing}; it has {sorted(batch)}")
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise BatchError(f"input_ids must be [B, P+T], got shape {tuple(ids.shape)}")
    rows, width = ids.shape
    responses = batch["responses"]
    if responses.dim() != 2 or responses.shape[0] != rows or responses.shape[1] > width:
        raise BatchError(f"responses must be [B, T] with B={rows} and T <= {width}, got {tuple(responses.shape)}")
    t = responses.shape[1]
    for key in SEQUENCE_KEYS:
        if tuple(batch[key].shape) != (rows, width):
            raise BatchError(f"{key} must have the shape of input_ids {(rows, width)}, got {tuple(batch[key].shape)}")
    for key in (*RESPONSE_KEYS, *(k for k in UPDATE_KEYS if k in batch)):
        if tuple(batch[key].shape) != (rows, t):
            raise BatchError(f"{key} must be [B, T] = {(rows, t)}, got {tuple(batch[key].shape)}")
    if ROUTES_KEY in batch and tuple(batch[ROUTES_KEY].shape[:2]) != (rows, width):
        raise BatchError(f"{ROUTES_KEY} must be [B, P+T, layers, k] with [B, P+T] = {(rows, width)}, got "
                         f"{tuple(batch[ROUTES_KEY].shape)}")
    if not torch.equal(ids[:, width - t:], responses):
        raise BatchError("responses differ from input_ids[:, -T:]; input_ids must be prompt ++ response")
    mask = batch["attention_mask"].bool()
    no_prompt = (~mask[:, :width - t].any(1)).nonzero().flatten().tolist()
    if no_prompt:
        raise BatchError(f"rows {no_prompt[:8]} have no attended prompt token; the first response token "
                         "needs at least one token before it")
    if (batch["response_mask"].bool() & ~mask[:, width - t:]).any():
        raise BatchError("response_mask is set on response positions that attention_mask leaves out")
    positions = mask.long().cumsum(1) - 1
    if not torch.equal(batch["position_ids"][mask], positions[mask]):
        raise BatchError("position_ids differ from cumsum(attention_mask) - 1 at attended tokens; mppo's "
                         "megatron forward derives positions from attention_mask (no custom position ids)")
    return rows, t


@dataclass
class MicroBatch:
    """Rows `rows` of a batch, ready for the pipeline: `data` holds the compacted `input_ids` [b, L],
    `response_index` [b, T] (output column predicting each response token), `response_valid` [b, T] and the
    batch's [b, T] response tensors. `real_tokens` counts the attended (non-padding) tokens of its rows."""

    rows: torch.Tensor
    data: dict[str, torch.Tensor]
    real_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Padded size b x L of the model input."""
        return self.data["input_ids"].numel()


def make_micro_batch(batch: Batch, rows: torch.Tensor, length_multiple: int = 1) -> MicroBatch:
    """Compact rows `rows` of a (validated) batch into one right-padded micro-batch, as long as its longest row
    rounded up to a multiple of `length_multiple`."""
    ids, mask = batch["input_ids"][rows], batch["attention_mask"][rows].bool()
    b, width = ids.shape
    t = batch["responses"].shape[1]
    dest = mask.long().cumsum(1) - 1  # compacted column of each attended token
    length = -(-int(mask.sum(1).max()) // length_multiple) * length_multiple
    compact = torch.zeros(b, length, dtype=ids.dtype, device=ids.device)
    row_of = torch.arange(b, device=ids.device)[:, None].expand(b, width)
    compact[row_of[mask], dest[mask]] = ids[mask]
    response_valid = mask[:, width - t:]
    data = {
        "input_ids": compact,
        # the output at column c-1 is about the token at column c; invalid entries point at column 0 (masked)
        "response_index": (dest[:, width - t:] - 1).clamp(min=0),
        "response_valid": response_valid,
    }
    for key in (*RESPONSE_KEYS, *UPDATE_KEYS):
        if key in batch:
            data[key] = batch[key][rows]
    if ROUTES_KEY in batch:  # compacted like input_ids; padding columns route to experts 0..k-1
        routes = batch[ROUTES_KEY][rows]
        k = routes.shape[-1]
        compact_routes = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(
            b, length, *routes.shape[2:]).clone()
        compact_routes[row_of[mask], dest[mask]] = routes[mask]
        data[ROUTES_KEY] = compact_routes
    return MicroBatch(rows=rows, data=data, real_tokens=int(mask.sum()))


@dataclass
class PhaseTokens:
    real: int = 0  # attended tokens of the rows
    processed: int = 0  # rows x columns of the model inputs actually run (padding included)
    micro_batches: int = 0

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real / self.processed if self.processed else 0.0


class TokenCounter:
    """Real vs processed tokens of the micro-batches this process hands to the pipeline schedules, by phase
    (e.g. "actor/update"). Padding costs compute without doing work, so `mppo bench step` reports it; counting
    is two integer additions per micro-batch, so it is always on."""

    def __init__(self) -> None:
        self.phases: dict[str, PhaseTokens] = {}

    def add(self, phase: str, real: int, processed: int) -> None:
        entry = self.phases.setdefault(phase, PhaseTokens())
        entry.real += real
        entry.processed += processed
        entry.micro_batches += 1

    def reset(self) -> None:
        self.phases.clear()

    def total(self) -> PhaseTokens:
        return PhaseTokens(sum(p.real for p in self.phases.values()), sum(p.processed for p in self.phases.values()),
                           sum(p.micro_batches for p in self.phases.values()))


TOKEN_COUNTER = TokenCounter()  # this process's counts; the workers add to it, benchmarks read and reset it


def split_by_count(rows: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    """Consecutive groups of at most `micro_batch_size` rows."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return list(rows.split(micro_batch_size))


# The fixed cost of one micro-batch (pipeline schedule, per-layer Python and kernel launches), in tokens of model
# compute: splitting a group in two is worth it when it saves more padded tokens than this. Estimate for the
# CPU bench model (bench/RESULTS.md): ~200 torch calls per micro-batch forward at ~20 us each, against ~0.1 ms
# of compute per token, is ~40 tokens. On GPUs a micro-batch costs more launches but budgets are thousands of
# tokens, so the padding a split saves dwarfs it either way.
MICRO_BATCH_OVERHEAD_TOKENS = 64


def split_by_tokens(rows: torch.Tensor, lengths: torch.Tensor, max_token_len: int, *,
                    overhead_tokens: int = MICRO_BATCH_OVERHEAD_TOKENS) -> list[torch.Tensor]:
    """Groups of rows whose padded size b x max(length) fits `max_token_len`, chosen to minimise the tokens the
    model processes (padding included) plus `overhead_tokens` per group.

    Rows are sorted longest first and grouped into runs of consecutive rows (some optimal grouping has that
    form: a group costs its size times its first row's length); the best runs come from dynamic programming over
    the sorted rows, best[i] = min over group ends j of (j - i) x length[i] + overhead + best[j].
    """
    import numpy as np

    longest = int(lengths[rows].max()) if len(rows) else 0
    if longest > max_token_len:
        raise ValueError(f"a sequence of {longest} tokens does not fit the micro-batch token budget "
                         f"{max_token_len}; raise ppo_max_token_len_per_gpu to at least {longest}")
    order = rows[torch.argsort(lengths[rows], descending=True, stable=True)]
    length = lengths[order].cpu().numpy().astype(np.int64)
    n = len(order)
    best = np.zeros(n + 1, dtype=np.int64)  # best[i]: cost of rows i.. (sorted order)
    end = np.full(n + 1, n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        ends = np.arange(i + 1, min(n, i + max_token_len // max(int(length[i]), 1)) + 1)
        cost = (ends - i) * length[i] + overhead_tokens + best[ends]
        pick = len(cost) - 1 - int(np.argmin(cost[::-1]))  # on ties, the larger group
        best[i], end[i] = cost[pick], ends[pick]
    groups, i = [], 0
    while i < n:
        groups.append(order[i:end[i]].clone())
        i = int(end[i])
    return groups


def split_to_multiple(groups: list[torch.Tensor], multiple: int) -> list[torch.Tensor]:
    """Split the largest groups in two until the number of groups is a multiple of `multiple` (the interleaved
    schedule needs a number of micro-batches divisible by PP)."""
    groups = list(groups)
    while len(groups) % multiple:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            raise ValueError(f"cannot make a multiple of {multiple} micro-batches from {len(groups)} single rows; "
                             "the interleaved pipeline needs more rows per mini-batch")
        g = groups.pop(largest)
        groups[largest:largest] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def make_micro_batches(batch: Batch, rows: torch.Tensor, *, micro_batch_size: int | None = None,
                       max_token_len: int | None = None, multiple_of: int = 1,
                       length_multiple: int = 1) -> list[MicroBatch]:
    """Micro-batches over `rows`: by count (`micro_batch_size`) or by token budget (`max_token_len`), a multiple
    of `multiple_of` of them, each as long as a multiple of `length_multiple`."""
    if (micro_batch_size is None) == (max_token_len is None):
        raise ValueError("give exactly one of micro_batch_size (by count) and max_token_len (token budget)")
    if micro_batch_size is not None:
        groups = split_by_count(rows, micro_batch_size)
        if len(groups) % multiple_of:
            raise ValueError(f"{len(rows)} rows in micro-batches of {micro_batch_size} make {len(groups)} "
                             f"micro-batches; the interleaved pipeline needs a multiple of {multiple_of}")
    else:
        lengths = batch["attention_mask"].bool().sum(1).cpu()  # host copy: grouping reads it row by row
        groups = split_to_multiple(split_by_tokens(rows, lengths, max_token_len), multiple_of)
    return [make_micro_batch(batch, g, length_multiple) for g in groups]


def pad_to_uniform(micro_batches: Sequence[MicroBatch]) -> list[dict[str, torch.Tensor]]:
    """Micro-batch data padded to one shape (rows, and input_ids' length) for the interleaved schedule.

    Padded rows have response_valid = response_mask = 0, so they add nothing to losses or counts; response
    tensors keep their width T (the seq-mean-token-sum-norm mode divides by it).
    """
    rows = max(mb.data["input_ids"].shape[0] for mb in micro_batches)
    length = max(mb.data["input_ids"].shape[1] for mb in micro_batches)
    padded = []
    for mb in micro_batches:
        b, s = mb.data["input_ids"].shape
        out = {}
        for key, t in mb.data.items():
            if key == ROUTES_KEY:  # [b, s, layers, k]: padding tokens route to experts 0..k-1 (k distinct ones)
                k = t.shape[-1]
                out[key] = torch.arange(k, dtype=t.dtype, device=t.device).expand(rows, length, *t.shape[2:]).clone()
                out[key][:b, :s] = t
                continue
            extra_cols = length - s if key == "input_ids" else 0
            out[key] = torch.nn.functional.pad(t, (0, extra_cols, 0, rows - b))
        padded.append(out)
    return padded


def mini_batch_rows(num_rows: int, mini_batch_size: int, *, shuffle: bool = False,
                    generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Row indices of each mini-batch of a DP rank's shard (veRL: `data.split(ppo_mini_batch_size)`)."""
    if num_rows % mini_batch_size:
        raise ValueError(f"this rank's {num_rows} rows do not split into mini-batches of {mini_batch_size}; "
                         "make the batch a multiple of ppo_mini_batch_size x rollout.n / dp")
    order = torch.randperm(num_rows, generator=generator) if shuffle else torch.arange(num_rows)
    return list(order.split(mini_batch_size))


def global_batch_info(response_mask: torch.Tensor, *, dp_group: dist.ProcessGroup | None,
                      dp_size: int) -> GlobalBatchInfo:
    """Valid tokens and non-empty sequences of a mini-batch summed over the DP group (collective over DP)."""
    counts = torch.stack([response_mask.sum(), (response_mask.sum(-1) > 0).sum()]).to(torch.float64)
    if dp_size > 1:
        dist.all_reduce(counts, group=dp_group)
    tokens, seqs = int(counts[0]), int(counts[1])
    return GlobalBatchInfo(dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=seqs)


def scatter_rows(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], num_rows: int) -> torch.Tensor:
    """Reassemble per-micro-batch [b, ...] results `(rows, values)` into batch order [num_rows, ...]."""
    first = parts[0][1]
    out = torch.zeros((num_rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    for rows, values in parts:
        out[rows.to(out.device)] = values
    return out
