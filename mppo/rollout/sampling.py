"""Choosing the next token of each sequence, with each sample's noise drawn from its own generator.

Sampling is Gumbel-max: token = argmax(filtered log-probs + Gumbel noise), where the noise for one sequence is a
fresh vocab-sized draw from THAT sequence's generator at every step. A sample's choice therefore depends only on
its own logits and its own random stream, never on which other sequences share the batch (torch.multinomial over
a batch would consume one shared stream in batch order). The noise and the sum are float64 so that a
last-bit difference in the logits cannot flip a choice except at a genuine near-tie.
"""
from __future__ import annotations

import torch

from mppo.rollout.base import SamplingParams


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


def gumbel_noise(vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """One float64 Gumbel(0, 1) draw per vocabulary entry from `generator`."""
    u = torch.rand(vocab_size, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(u))  # u == 0 gives -inf: that token can never win, which is harmless


def choose_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its rollout log-prob for each row of `logits` [rows, vocab]; generators[i] belongs to row i."""
    # No torch-function modes here (see PackedCausalLM.forward): a call per row per token, CPU tensors only.
    with torch._C.DisableTorchFunction():
        return _choose_tokens(logits, sampling, generators)


def _choose_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.shape[0] != len(generators):
        raise ValueError(f"{logits.shape[0]} logit rows but {len(generators)} generators")
    log_probs = rollout_log_probs(logits, sampling)
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)  # first maximum on ties, as HF generate
    else:
        allowed = filter_top_k_top_p(log_probs, sampling.top_k, sampling.top_p)
        noise = torch.stack([gumbel_noise(logits.shape[-1], g) for g in generators])
        tokens = (allowed.double() + noise).argmax(dim=-1)
    return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]
