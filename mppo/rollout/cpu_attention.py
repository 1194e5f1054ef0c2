"""Attention of the CPU engine: per-prompt prefill, and decode over every live sample in one set of calls per layer.

KV cache (preallocated per generate() call, see PromptKV / SampleKV): a prompt's keys and values are computed
once and shared by its n samples; each sample keeps only the keys and values of its own generated tokens. Decode
attention works in the slot layout: slot = prompt * n + sample index, n slots per prompt still running, whether
or not each slot's sample is still alive (mppo.rollout.cpu_decode maps batch rows to slots). A step attends in
two parts, each a softmax piece (maximum, exp-weighted sums) that are merged as flash-decoding merges splits:
- the prompt part, per prompt and KV head: the queries of its n samples (n x group of them) against the prompt's
  keys, one matrix product for all its samples (the prompt is most of the context);
- the own part, per slot: its queries against its own generated tokens, which at step t all slots have t + 1 of.
Values carry an extra column of ones, so the weights x values product also yields the softmax denominator.

Batch invariance (a sample's tokens and log-probs are bitwise the same whatever else is in the batch, with
single-threaded torch) holds by construction, from these rules (tests/test_rollout_cpu_engine.py checks the BLAS
properties they rest on, on the machine it runs on):
- a matrix product with >= MIN_QUERIES rows and >= OWN_BLOCK columns gets the same bits wherever its matrices lie
  in memory and however many matrices the batched call holds; q @ k^T's entries also do not depend on how many
  key columns there are. So prompt keys may be padded to the batch's longest prompt (padding positions are
  masked to -inf: weight exactly 0) and the scores of real positions keep their bits;
- a product whose REDUCTION length would depend on the batch is cut into blocks of BLOCK positions: the prompt
  part's weights x values is a [queries x BLOCK] @ [BLOCK x value_width] product per block, and the block results
  are added up with cumsum (a plain running sum along the block axis), to which an all-padding block adds 0;
- the own part's key axis is the step's t + 1 rounded up to OWN_BLOCK (the rest masked): the same for every slot;
- the maximum is exact in any order, exp(-inf) = 0, and the elementwise ops (exp and exact IEEE ops) give an
  element the same bits wherever it sits in a tensor (see mppo.rollout.cpu_model).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# Weights x values of the prompt part is computed in blocks of this many positions (see the module docstring).
BLOCK = 32
# Every product has at least MIN_QUERIES rows and its key axis a multiple of OWN_BLOCK (>= 16) columns: with fewer
# (measured: < 4 rows, or < 12 columns) the CPU BLAS takes kernels whose results depend on where the matrix lies
# in memory, i.e. on its place in the batch. Queries are padded with zero rows; the own part's key axis is cut
# at the next multiple of OWN_BLOCK, with the positions after the current one masked.
MIN_QUERIES = 4
OWN_BLOCK = 16


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _values_with_ones(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A values buffer [..., value_width(head_dim)]: zeros, and ones in column head_dim (the softmax denominator's)."""
    head_dim = shape[-1]
    values = torch.zeros(shape[:-1] + (value_width(head_dim),), dtype=dtype)
    values[..., head_dim] = 1.0
    return values


def value_width(head_dim: int) -> int:
    """Columns of a values buffer: head_dim, the ones column, and zero columns up to OWN_BLOCK (see MIN_QUERIES)."""
    return max(head_dim + 1, OWN_BLOCK)


@dataclasses.dataclass
class PromptKV:
    """Keys and values of the prompts, one entry per prompt, shared by the prompt's samples during decode."""

    keys: list[torch.Tensor]  # per layer [prompts, kv_heads, padded_length, head_dim], padded_length % BLOCK == 0
    values: list[torch.Tensor]  # per layer [prompts, kv_heads, padded_length, value_width], see _values_with_ones
    lengths: torch.Tensor  # int64 [prompts]
    mask: torch.Tensor  # [prompts, 1, 1, padded_length], added to scores: 0, or -inf past the prompt's length

    @classmethod
    def allocate(cls, lengths: list[int], num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> PromptKV:
        padded = round_up(max(lengths), BLOCK)
        shape = (len(lengths), kv_heads, padded, head_dim)
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        mask = torch.zeros(len(lengths), 1, 1, padded, dtype=dtype)
        mask.masked_fill_(torch.arange(padded).view(1, 1, 1, -1) >= lengths_t.view(-1, 1, 1, 1), float("-inf"))
        # padding positions hold zeros (finite: weight 0 x value 0 adds exactly 0)
        return cls(keys=[torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
                   values=[_values_with_ones(shape, dtype) for _ in range(num_layers)],
                   lengths=lengths_t, mask=mask)

    def select(self, prompts: torch.Tensor) -> PromptKV:
        """Only the given prompts (indices), e.g. those that still have live samples."""
        return PromptKV([k[prompts] for k in self.keys], [v[prompts] for v in self.values], self.lengths[prompts],
                        self.mask[prompts])


@dataclasses.dataclass
class SampleKV:
    """Keys and values of each slot's generated tokens, per layer [prompts, kv_heads, n, capacity, head_dim]
    (values: value_width columns, see _values_with_ones); capacity % OWN_BLOCK == 0."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor  # [capacity + OWN_BLOCK]: capacity zeros, then -inf (sliced per step, see decode_attention)

    @classmethod
    def allocate(cls, prompts: int, n: int, capacity: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> SampleKV:
        capacity = round_up(capacity, OWN_BLOCK)
        shape = (prompts, kv_heads, n, capacity, head_dim)
        mask = torch.zeros(capacity + OWN_BLOCK, dtype=dtype)
        mask[capacity:] = float("-inf")
        return cls([torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
                   [_values_with_ones(shape, dtype) for _ in range(num_layers)], mask)

    def select(self, prompts: torch.Tensor) -> SampleKV:
        """Only the given prompts' slots."""
        return SampleKV([k[prompts] for k in self.keys], [v[prompts] for v in self.values], self.mask)


@dataclasses.dataclass
class DecodeLayout:
    """Which batch row holds which slot during decode, for one run of steps between compactions.

    Row-wise layers run on batch rows (live samples, then padding up to MIN_ROWS); attention runs on slots. A slot
    whose sample has stopped maps to any row and a padding row to any slot: they compute on stale but finite
    inputs, never influence anything else (rows and slots are independent), and their results are ignored.
    """

    n: int  # samples per prompt
    slot_rows: torch.Tensor | None  # int64 [prompts * n]: the row holding each slot; None: row i holds slot i
    row_slots: torch.Tensor | None  # int64 [rows]: the slot of each row; None: the identity

    def to_slots(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.slot_rows is None else x[self.slot_rows]

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.row_slots is None else x[self.row_slots]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cache: PromptKV,
                      layer: int, starts: list[int]) -> torch.Tensor:
    """Causal attention of each packed prompt over itself; stores its keys/values in `cache` (layer `layer`).

    q [rows, heads, head_dim], k/v [rows, kv_heads, head_dim], prompt i at rows starts[i]:starts[i]+length[i].
    Returns [rows, heads, head_dim] (rows after the last prompt stay zero).
    """
    head_dim = q.shape[-1]
    keys, values = cache.keys[layer], cache.values[layer][..., :head_dim]
    q_heads, k_heads, v_heads = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    out = torch.zeros_like(q)
    out_heads = out.transpose(0, 1)
    for prompt, (start, length) in enumerate(zip(starts, cache.lengths.tolist())):
        end = start + length
        keys[prompt, :, :length] = k_heads[:, start:end]
        values[prompt, :, :length] = v_heads[:, start:end]
        # one call per prompt, shaped by that prompt alone
        out_heads[:, start:end] = F.scaled_dot_product_attention(
            q_heads[None, :, start:end], keys[prompt : prompt + 1, :, :length], values[prompt : prompt + 1, :, :length],
            is_causal=True, scale=scale, enable_gqa=True)[0]
    return out


def _at_least_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., r, d] with zero rows appended up to `rows` (see MIN_QUERIES)."""
    return x if x.shape[-2] >= rows else F.pad(x, (0, 0, 0, rows - x.shape[-2]))


def _softmax_part(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maxima of `scores` [..., queries, keys] and exp(scores - max), in place."""
    top = scores.amax(dim=-1)
    return top, scores.sub_(top[..., None]).exp_()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prompts: PromptKV,
                     samples: SampleKV, layer: int, step: int, n: int) -> torch.Tensor:
    """One decode step for every slot: q [slots, heads, head_dim], k/v [slots, kv_heads, head_dim] of the token at
    generated position `step`, whose keys/values are stored first. Returns [slots, heads, head_dim]."""
    slots, heads, head_dim = q.shape
    num_prompts, kv_heads = prompts.lengths.shape[0], k.shape[1]
    group = heads // kv_heads
    queries = n * group  # per prompt and KV head
    own_keys, own_values = samples.keys[layer], samples.values[layer]
    own_keys[:, :, :, step] = k.view(num_prompts, n, kv_heads, head_dim).transpose(1, 2)
    own_values[:, :, :, step, :head_dim] = v.view(num_prompts, n, kv_heads, head_dim).transpose(1, 2)
    q = (q * scale).view(num_prompts, n, kv_heads, group, head_dim).transpose(1, 2)  # [P, kv, n, group, hd]

    # prompt part: [P, kv, queries(+pad), padded length] scores, then weights x values block by block
    scores = torch.matmul(_at_least_rows(q.reshape(num_prompts, kv_heads, queries, head_dim), MIN_QUERIES),
                          prompts.keys[layer].transpose(-1, -2)).add_(prompts.mask)
    prompt_max, weights = _softmax_part(scores)
    blocks = prompts.keys[layer].shape[2] // BLOCK
    weight_blocks = weights.view(num_prompts, kv_heads, -1, blocks, BLOCK).transpose(2, 3)
    width = prompts.values[layer].shape[-1]
    value_blocks = prompts.values[layer].view(num_prompts, kv_heads, blocks, BLOCK, width)
    prompt_sum = torch.matmul(weight_blocks, value_blocks).cumsum(dim=2)[:, :, -1, :queries]  # [P, kv, queries, width]

    # own part: [P, kv, n, group(+pad), keys] with the keys 0..step, and up to the next multiple of OWN_BLOCK masked
    keys = round_up(step + 1, OWN_BLOCK)
    own_mask = samples.mask[samples.mask.shape[0] - OWN_BLOCK - (step + 1) :][:keys]  # step + 1 zeros, then -inf
    own_scores = torch.matmul(_at_least_rows(q, MIN_QUERIES), own_keys[:, :, :, :keys].transpose(-1, -2))
    own_max, own_weights = _softmax_part(own_scores.add_(own_mask))
    own_sum = torch.matmul(own_weights, own_values[:, :, :, :keys])[:, :, :, :group]  # [P, kv, n, group, width]

    # merge the two parts (as flash-decoding merges splits)
    prompt_max = prompt_max[:, :, :queries].view(num_prompts, kv_heads, n, group, 1)
    own_max = own_max[:, :, :, :group, None]
    top = torch.maximum(prompt_max, own_max)
    total = (prompt_sum.view(num_prompts, kv_heads, n, group, width) * torch.exp(prompt_max - top)
             + own_sum * torch.exp(own_max - top))
    out = total[..., :head_dim] / total[..., head_dim : head_dim + 1]  # numerator / denominator
    return out.transpose(1, 2).reshape(slots, heads, head_dim)
