"""Next-token log-probs, entropy, critic values and logits of right-padded test micro-batches, computed through the
workers' forward path (mppo.workers.pipeline / logprob / critic), the one the trainer runs.

The model tests feed micro-batches {"input_ids": [b, s]} and compare every column with HF: log-probs and entropy
at column t are about token t+1 (the last column, which has no next token, is 0); values and logits are those at
column t. `next_token_batch` writes the micro-batches as one batch in the workers' data contract: a one-token
prompt (column 0) and the rest of each row as its response, plus one extra token after each row so that the
value and logits at the row's last column are read too; response column j is then read at input column j.
"""
from __future__ import annotations

from typing import Sequence

import torch

# rows per micro-batch of the workers' path: the test rows of uneven lengths then make micro-batches of uneven
# shapes (the interleaved schedule pads them to one), and 8 test rows make a multiple of PP=2 micro-batches
MICRO_BATCH_ROWS = 2


def next_token_batch(micro_batches: Sequence[dict]) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, int]]]:
    """(one batch in the workers' data contract, (first row, rows, columns) of each test micro-batch in it)."""
    spans, rows = [], 0
    for mb in micro_batches:
        b, s = mb["input_ids"].shape
        spans.append((rows, b, s))
        rows += b
    width = max(s for _, _, s in spans) + 1  # + the extra token after the longest row
    device = micro_batches[0]["input_ids"].device
    ids = torch.zeros(rows, width, dtype=torch.long, device=device)
    attended = torch.zeros_like(ids)
    for (start, b, s), mb in zip(spans, micro_batches):
        ids[start:start + b, :s] = mb["input_ids"]
        attended[start:start + b, :s + 1] = 1
    batch = {"input_ids": ids, "attention_mask": attended, "position_ids": (attended.cumsum(1) - 1).clamp(min=0),
             "responses": ids[:, 1:].clone(), "response_mask": attended[:, 1:].float()}
    return batch, spans


def split_back(values: torch.Tensor, spans: list[tuple[int, int, int]], *, next_token: bool) -> list[torch.Tensor]:
    """Batch-row results [rows, T, ...] -> each test micro-batch's [b, s, ...]; `next_token`: the last column
    (about the extra token, not a next token of the row) is 0."""
    out = []
    for start, b, s in spans:
        part = values[start:start + b, :s].clone()
        if next_token:
            part[:, -1] = 0
        out.append(part)
    return out


def has_next_token(response_valid: torch.Tensor) -> torch.Tensor:
    """Response columns whose token is a real next token (not the extra one after the row): the valid columns
    followed by another valid column."""
    keep = torch.zeros_like(response_valid)
    keep[:, :-1] = response_valid[:, :-1] & response_valid[:, 1:]
    return keep


def token_logprobs(chunks, micro_batches: Sequence[dict], *, vocab_size: int, temperature: float,
                   impl: str = "naive", kernel_backend: str = "auto",
                   micro_batch_size: int = MICRO_BATCH_ROWS) -> list[dict[str, torch.Tensor]]:
    """{"log_probs", "entropy"} [b, s] fp32 per test micro-batch, on every rank (`impl`: actor.logprob_impl)."""
    from mppo.workers.logprob import compute_response_outputs, make_logprob_fn

    batch, spans = next_token_batch(micro_batches)
    outs = compute_response_outputs(chunks, batch, make_logprob_fn(impl, kernel_backend), vocab_size=vocab_size,
                                    temperature=temperature, micro_batch_size=micro_batch_size, max_token_len=None,
                                    calculate_entropy=True, phase="test/log_prob")
    lp, ent = (split_back(outs[k], spans, next_token=True) for k in ("log_probs", "entropy"))
    return [{"log_probs": a, "entropy": b} for a, b in zip(lp, ent)]


def token_values(critic_chunks, micro_batches: Sequence[dict],
                 micro_batch_size: int = MICRO_BATCH_ROWS) -> list[dict[str, torch.Tensor]]:
    """{"values"} [b, s] fp32 per test micro-batch, on every rank."""
    from mppo.workers.critic import compute_response_values

    batch, spans = next_token_batch(micro_batches)
    values = compute_response_values(critic_chunks, batch, micro_batch_size=micro_batch_size, max_token_len=None,
                                     phase="test/values")
    return [{"values": v} for v in split_back(values, spans, next_token=False)]


def token_logits(chunks, micro_batches: Sequence[dict], vocab_size: int,
                 micro_batch_size: int = MICRO_BATCH_ROWS) -> list[dict[str, torch.Tensor]]:
    """{"logits"} [b, s, vocab] (TP-gathered, vocabulary padding cut) per test micro-batch, on every rank."""
    from megatron.core import tensor_parallel

    from mppo.workers.base import response_rows
    from mppo.workers.pipeline import micro_batches_for, response_forward_step, run_forward_only

    batch, spans = next_token_batch(micro_batches)
    rows = torch.arange(batch["input_ids"].shape[0])

    def make_loss_fn(model, data):
        def loss_fn(logits):  # [b, s, V / tp], batch-first
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
            return logits.sum() * 0.0, {"logits": response_rows(full.transpose(0, 1), data, valid_only=False)}
        return loss_fn

    micro = micro_batches_for(batch, rows, chunks, micro_batch_size=micro_batch_size, max_token_len=None)
    with torch.no_grad():
        outs = run_forward_only(chunks, micro, response_forward_step(make_loss_fn, hidden_only=False), len(rows),
                                phase="test/logits")
    return [{"logits": v} for v in split_back(outs["logits"], spans, next_token=False)]


def unpadded_micro_batches(chunks, micro_batches: Sequence[dict],
                           micro_batch_size: int = MICRO_BATCH_ROWS) -> list[dict[str, torch.Tensor]]:
    """The workers' micro-batch data of the test micro-batches without `pipeline_inputs`' padding (uneven shapes)."""
    from mppo.workers.pipeline import micro_batches_for

    batch, _ = next_token_batch(micro_batches)
    rows = torch.arange(batch["input_ids"].shape[0])
    return [mb.data for mb in micro_batches_for(batch, rows, chunks, micro_batch_size=micro_batch_size,
                                                max_token_len=None)]


def next_token_loss_step(chunks, micro_batches: Sequence[dict], *, vocab_size: int, temperature: float,
                         entropy_coeff: float | None = None, impl: str = "naive", kernel_backend: str = "auto",
                         micro_batch_size: int = MICRO_BATCH_ROWS):
    """(pipeline inputs, forward step) for `run_pipeline(chunks, inputs, step, forward_only=False)` with the loss
    sum(next-token log-probs) [+ entropy_coeff * sum(entropy)] over every test micro-batch, through the workers'
    forward step and log-prob function (`impl`: actor.logprob_impl). entropy_coeff None: no entropy computed."""
    from mppo.workers.logprob import make_logprob_fn, response_logprobs
    from mppo.workers.pipeline import micro_batches_for, pipeline_inputs, response_forward_step

    batch, _ = next_token_batch(micro_batches)
    rows = torch.arange(batch["input_ids"].shape[0])
    logprob_fn = make_logprob_fn(impl, kernel_backend)

    def make_loss_fn(model, data):
        def loss_fn(hidden):
            log_probs, entropy = response_logprobs(model, hidden, data, logprob_fn, temperature=temperature,
                                                   vocab_size=vocab_size, compute_entropy=entropy_coeff is not None)
            keep = has_next_token(data["response_valid"])
            loss = (log_probs * keep).sum()
            if entropy is not None:
                loss = loss + entropy_coeff * (entropy * keep).sum()
            return loss, {}
        return loss_fn

    micro = micro_batches_for(batch, rows, chunks, micro_batch_size=micro_batch_size, max_token_len=None)
    return (pipeline_inputs(chunks, micro, phase="test/update"),
            response_forward_step(make_loss_fn, hidden_only=True))
