"""Choosing the next token of every sequence at once: inverse-CDF sampling with counter-based random numbers.

Randomness: one uniform per (sample, token position), u = the (position + 1)-th output of SplitMix64 started at
the sample's seed (mppo.rollout.seeding), i.e. mix(seed + (position + 1) * golden_gamma). It is a pure function of
(sample seed, position), computed for all samples and a block of positions at once with a few int64 tensor ops
(no generator objects, no Python per row): a sample's draws never depend on which other samples share the batch, how many steps ran
before, or which rank generates it, and a resumed run draws exactly what the uninterrupted one would have.

Sampling: token = the first index whose cumulative (float64) probability under the filtered distribution
exceeds u x its total, i.e. the inverse CDF in vocabulary order. One uniform per row and a sequential cumsum
per row are much cheaper than Gumbel-max's vocabulary-sized noise draw (two logs per entry), which matters at
real vocabulary sizes (~150k). Rows are independent (the cumsum runs along each row on its own), and a
last-bit difference in the logits (multi-threaded BLAS) moves a choice only when u falls within ~1e-7 of a
boundary of the cumulative distribution: a genuine near-tie.
"""
from __future__ import annotations

import torch

from mppo.rollout.base import SamplingParams

_MASK64 = (1 << 64) - 1
# SplitMix64 (Steele, Lea, Flood 2014; Vigna's splitmix64.c): the state advances by the golden gamma, each output
# is the state passed through two xor-shift-multiply rounds.
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def _as_int64(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned `value` (torch has no uint64 arithmetic on CPU)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic on negative values)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
    """float64 uniforms in [0, 1), one per row: SplitMix64 output number positions + 1 for the stream at `seeds`.

    seeds: int64 [rows] (the 63-bit sample seeds); positions: int64 [rows] or one int (token index, from 0).
    int64 additions and multiplications wrap modulo 2^64 in torch (two's complement), which is the unsigned
    arithmetic SplitMix64 needs; tests compare the bits with a pure-Python implementation.
    """
    z = seeds.to(torch.int64) + (torch.as_tensor(positions, dtype=torch.int64) + 1) * _as_int64(SPLITMIX_GAMMA)
    z = (z ^ _shift_right(z, 30)) * _as_int64(SPLITMIX_MULTIPLIERS[0])
    z = (z ^ _shift_right(z, 27)) * _as_int64(SPLITMIX_MULTIPLIERS[1])
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() * 2.0**-53  # the top 53 bits: every value exact in float64


def rollout_log_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """log-softmax of the sampling distribution over the full vocabulary (no top-k/top-p), as SGLang returns it."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(logits.float() / sampling.temperature, dim=-1)


def filter_top_k_top_p(log_probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the log-probs of tokens outside the top-k / top-p (nucleus) set to -inf; rows are independent.

    Same rule as SGLang's pytorch sampling backend: sort descending, drop ranks >= top_k, then drop every token
    whose preceding (unrenormalised) probability mass already exceeds top_p. The most likely token always stays.
    """
    if top_k == -1 and top_p == 1.0:
        return log_probs
    sorted_lp, order = torch.sort(log_probs, dim=-1, descending=True, stable=True)
    ranks = torch.arange(log_probs.shape[-1], device=log_probs.device)
    remove = torch.zeros_like(sorted_lp, dtype=torch.bool)
    if top_k != -1:
        remove |= ranks >= top_k
    if top_p < 1.0:
        probs = sorted_lp.exp()
        remove |= (probs.cumsum(dim=-1) - probs) > top_p
    sorted_lp = sorted_lp.masked_fill(remove, float("-inf"))
    return torch.empty_like(log_probs).scatter_(-1, order, sorted_lp)


def choose_tokens(
    logits: torch.Tensor, sampling: SamplingParams, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its rollout log-prob for each row of `logits` [rows, vocab]; uniforms[i] (float64 in [0, 1),
    see counter_uniforms) is row i's random number. Greedy rows take the first maximum, as HF generate."""
    if logits.shape[0] != uniforms.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows but {uniforms.shape[0]} uniforms")
    # CPU tensors only: skip the torch-function modes of mppo.parallel.cpu_compat (see PackedCausalLM.forward)
    with torch._C.DisableTorchFunction():
        log_probs = rollout_log_probs(logits, sampling)
        if sampling.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            allowed = filter_top_k_top_p(log_probs, sampling.top_k, sampling.top_p)
            cdf = allowed.double().exp().cumsum(dim=-1)
            # u < 1 keeps the target below the total, so the first cdf entry above it is a token of nonzero
            # probability (the cdf is flat over removed tokens); the clamp only guards the index range.
            target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
        return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]
