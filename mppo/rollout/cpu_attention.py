"""Attention of the CPU engine: per-prompt prefill, and decode over every live sample in one set of calls per layer.

KV cache (preallocated per generate() call, see PromptKV / SampleKV): a prompt's keys and values are computed
once and shared by its n samples; each sample keeps only the keys and values of its own generated tokens. A
decode step attends in two parts whose softmax pieces are merged exactly as flash-decoding merges splits:
- the prompt part, per prompt: the queries of its n samples (n x group rows) against the prompt's keys, so each
  prompt's cache is read once per step for all its samples (this is most of the context);
- the own part, per sample: its query against its own generated tokens, which at step t all samples have the
  same number of (t + 1).

Batch invariance (a sample's tokens and log-probs are bitwise the same whatever else is in the batch, with
single-threaded torch) holds by construction, from these rules:
- every matrix product has shapes that depend on the sample (or its prompt) alone: prompt keys are cut in blocks
  of BLOCK positions, so a prompt's products are [n*group x head_dim] @ [head_dim x BLOCK] however long the
  batch's longest prompt is, and blocks beyond a prompt's length (padding up to the longest) are masked;
- reductions whose length would depend on the batch are made sequentially: block sums are added up with cumsum
  (a plain running sum along the block axis), where an all-masked block adds exactly 0; the max is exact in any
  order, and exp(-inf) = 0, so padding blocks change no bit;
- the own part's length is the step's (t + 1), the same for every live sample in any batch;
- the elementwise ops (exp and exact IEEE ops) give an element the same bits wherever it sits in a tensor (see
  mppo.rollout.cpu_model), and every product and reduction over rows runs on >= MIN_ROWS rows or per matrix.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# Prompt keys are processed in blocks of this many positions (a multiple of 32: see the module docstring).
BLOCK = 32


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass
class PromptKV:
    """Keys and values of the prompts, one row per prompt, shared by the prompt's samples during decode."""

    keys: list[torch.Tensor]  # per layer [prompts, kv_heads, padded_length, head_dim], padded_length % BLOCK == 0
    values: list[torch.Tensor]  # the same; positions past a prompt's length hold zeros (finite, masked out)
    lengths: torch.Tensor  # int64 [prompts]
    mask: torch.Tensor  # [prompts, 1, blocks, 1, BLOCK], added to scores: 0, or -inf past the prompt's length

    @classmethod
    def allocate(cls, lengths: list[int], num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> PromptKV:
        padded = round_up(max(lengths), BLOCK)
        shape = (len(lengths), kv_heads, padded, head_dim)
        lengths_t = torch.tensor(lengths, dtype=torch.int64)
        positions = torch.arange(padded).view(1, 1, padded // BLOCK, 1, BLOCK)
        mask = torch.zeros(len(lengths), 1, padded // BLOCK, 1, BLOCK, dtype=dtype)
        mask.masked_fill_(positions >= lengths_t.view(-1, 1, 1, 1, 1), float("-inf"))
        return cls(keys=[torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
                   values=[torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
                   lengths=lengths_t, mask=mask)

    def select(self, prompts: torch.Tensor) -> PromptKV:
        """Only the given prompts (rows), e.g. those that still have live samples."""
        return PromptKV([k[prompts] for k in self.keys], [v[prompts] for v in self.values], self.lengths[prompts],
                        self.mask[prompts])


@dataclasses.dataclass
class SampleKV:
    """Keys and values of each batch row's generated tokens: per layer [rows, kv_heads, capacity, head_dim]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, rows: int, capacity: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype) -> SampleKV:
        shape = (rows, kv_heads, capacity, head_dim)
        return cls([torch.zeros(shape, dtype=dtype) for _ in range(num_layers)],
                   [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)])

    def select(self, rows: torch.Tensor) -> SampleKV:
        return SampleKV([k[rows] for k in self.keys], [v[rows] for v in self.values])


@dataclasses.dataclass
class DecodeLayout:
    """Which batch row holds which sample during decode, for one run of steps between compactions.

    Samples are numbered prompt-major within the current prompts (slot = prompt * n + sample index). A row that
    holds no live sample (finished and not yet compacted, or padding up to MIN_ROWS) still computes, on stale
    but finite inputs; rows never influence each other, so its results are simply ignored.
    """

    n: int  # samples per prompt
    slot_rows: torch.Tensor  # int64 [prompts * n]: the row holding each slot (any row when it holds none)
    row_slots: torch.Tensor  # int64 [rows]: the slot of each row (any slot for padding rows)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cache: PromptKV,
                      layer: int, starts: list[int]) -> torch.Tensor:
    """Causal attention of each packed prompt over itself; stores its keys/values in `cache` (layer `layer`).

    q [rows, heads, head_dim], k/v [rows, kv_heads, head_dim], prompt i at rows starts[i]:starts[i]+length[i].
    Returns [rows, heads, head_dim] (rows after the last prompt stay zero).
    """
    keys, values = cache.keys[layer], cache.values[layer]
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


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prompts: PromptKV,
                     samples: SampleKV, layer: int, step: int, layout: DecodeLayout) -> torch.Tensor:
    """One decode step for every row: q [rows, heads, head_dim], k/v [rows, kv_heads, head_dim] of the token at
    generated position `step`, whose keys/values are stored first. Returns [rows, heads, head_dim]."""
    rows, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    own_keys, own_values = samples.keys[layer], samples.values[layer]
    own_keys[:, :, step] = k
    own_values[:, :, step] = v
    q = (q * scale).view(rows, kv_heads, group, head_dim)

    # prompt part, per prompt: [prompts, kv_heads, blocks, n*group, BLOCK]
    num_prompts = prompts.lengths.shape[0]
    n = layout.n
    q_slots = q[layout.slot_rows].view(num_prompts, n, kv_heads, group, head_dim).transpose(1, 2)
    q_slots = q_slots.reshape(num_prompts, kv_heads, 1, n * group, head_dim)
    blocks = prompts.keys[layer].shape[2] // BLOCK
    key_blocks = prompts.keys[layer].view(num_prompts, kv_heads, blocks, BLOCK, head_dim)
    value_blocks = prompts.values[layer].view(num_prompts, kv_heads, blocks, BLOCK, head_dim)
    scores = torch.matmul(q_slots, key_blocks.transpose(-1, -2)).add_(prompts.mask)  # s + 0 == s exactly
    prompt_max = scores.amax(dim=(2, 4), keepdim=True)
    weights = torch.exp(scores - prompt_max)
    prompt_den = weights.sum(dim=-1).cumsum(dim=2)[:, :, -1]  # [prompts, kv_heads, n*group]
    prompt_num = torch.matmul(weights, value_blocks).cumsum(dim=2)[:, :, -1]  # [prompts, kv_heads, n*group, hd]

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [prompts, kv_heads, n*group, ...] -> [rows, kv_heads, group, ...]
        x = x.reshape(num_prompts, kv_heads, n, group, *x.shape[3:]).transpose(1, 2)
        return x.reshape(num_prompts * n, kv_heads, group, *x.shape[4:])[layout.row_slots]

    prompt_max = to_rows(prompt_max.view(num_prompts, kv_heads, n * group))
    prompt_den, prompt_num = to_rows(prompt_den), to_rows(prompt_num)

    # own part, per row: its generated positions 0..step
    own_scores = torch.matmul(q, own_keys[:, :, : step + 1].transpose(-1, -2))  # [rows, kv_heads, group, step+1]
    own_max = own_scores.amax(dim=-1)
    own_weights = torch.exp(own_scores - own_max[..., None])
    own_den = own_weights.sum(dim=-1)
    own_num = torch.matmul(own_weights, own_values[:, :, : step + 1])

    # merge the two softmax pieces
    top = torch.maximum(prompt_max, own_max)
    prompt_scale, own_scale = torch.exp(prompt_max - top), torch.exp(own_max - top)
    num = prompt_num * prompt_scale[..., None] + own_num * own_scale[..., None]
    den = prompt_den * prompt_scale + own_den * own_scale
    return (num / den[..., None]).view(rows, heads, head_dim)
