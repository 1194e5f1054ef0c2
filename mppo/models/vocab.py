"""Vocabulary padding: the embedding and output layer hold a padded vocabulary split evenly over TP ranks.

The padded size is a multiple of lcm(make_vocab_size_divisible_by, tp). With the default 128 and a power-of-two
TP (<= 128) that is the same number at every TP size, so a dist checkpoint saved at one TP loads at another.
The padded rows are zero weights, so their logits are 0, not -inf: log-softmax and entropy must mask them out,
using `valid_vocab_size_per_rank` for the rank's own shard.
"""
from __future__ import annotations

import math

import torch


def padded_vocab_size(vocab_size: int, tp: int, make_vocab_size_divisible_by: int = 128) -> int:
    """Smallest multiple of lcm(make_vocab_size_divisible_by, tp) that holds `vocab_size` tokens."""
    multiple = math.lcm(make_vocab_size_divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def valid_vocab_size_per_rank(vocab_size: int, padded_size: int, tp_rank: int, tp: int) -> int:
    """How many of this TP rank's `padded_size // tp` vocabulary rows are real tokens (the rest are padding)."""
    if padded_size % tp != 0:
        raise ValueError(f"padded vocab {padded_size} is not divisible by tp {tp}")
    per_rank = padded_size // tp
    return max(0, min(per_rank, vocab_size - tp_rank * per_rank))


def mask_padded_logits(logits: torch.Tensor, valid_vocab_size: int) -> torch.Tensor:
    """Copy of a rank's vocab-parallel logits [..., V_local] with the padded columns set to the dtype's minimum.

    The minimum rather than -inf keeps p*log(p) finite (0 * min = 0) in entropy; exp(min - max) is still 0.
    """
    if valid_vocab_size >= logits.shape[-1]:
        return logits
    masked = logits.clone()
    masked[..., valid_vocab_size:] = torch.finfo(logits.dtype).min
    return masked
