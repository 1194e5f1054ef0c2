"""The CPU engine's generation loop: prefill once per prompt, then decode every live sample in one batch per step.

Per step, for all rows at once and with no Python per sample: one forward (mppo.rollout.cpu_model), one uniform
per row (counter-based, from the sample's seed and the token position), the token choice, and the stop check.
Samples that stop stay in the batch as dead rows (rows never influence each other) until a quarter of the rows
or of the prompts are dead: then the batch is compacted (live rows; the prompt and own caches of the prompts that
still have a live sample, whose stopped samples' slots stay and compute on, ignored).

Threads: with torch set to k > 1 intra-op threads, the prompts are split into k groups that k workers generate
concurrently, each with single-threaded torch (the GIL is released inside torch ops, so one worker's kernels
overlap the others' Python). A sample's result does not depend on its batch, so this gives bitwise the same
rollouts as one thread, unlike k-thread kernels (mppo.rollout.cpu_model); per-op thread barriers, which make
small ops slower with two threads than with one, are avoided too.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable

import torch

from mppo.rollout.base import SamplingParams
from mppo.rollout.cpu_attention import DecodeLayout, PromptKV, SampleKV
from mppo.rollout.cpu_model import MIN_ROWS, PackedCausalLM, Rope
from mppo.rollout.sampling import choose_tokens, counter_uniforms

# token ids, log-probs, finish reason, and with routing recorded the routed experts of every token the model ran
# [prompt + generated - 1, MoE layers, top_k] (the last generated token is never fed back), else None
Result = tuple[list[int], list[float], str, "torch.Tensor | None"]
# Random numbers are drawn for this many token positions of every sample at once (one tensor expression).
UNIFORM_BLOCK = 64
SLOW_DECODE_ENV = "MPPO_FAULT_SLOW_DECODE_S"  # seconds every decode step sleeps (see mppo.trainer.faults)


@dataclasses.dataclass(frozen=True)
class Continuation:
    """Partial rollouts (mppo.rollout.partial): per sample, the tokens it generated already (its random stream's
    position) and how many it may still generate; `interrupt` is asked after every decode step."""

    offsets: list[int]
    budgets: list[int]
    interrupt: Callable[[], bool] | None = None


@dataclasses.dataclass
class _Batch:
    """The decode batch: row i < len(samples) holds sample samples[i]; rows past them are padding."""

    prompt_ids: torch.Tensor  # int64 [prompts]: local prompt numbers whose caches are in `prompts` and `own`
    samples: torch.Tensor  # int64 [live rows]: local sample numbers (prompt * n + sample index)
    alive: torch.Tensor  # bool [live rows]: not stopped yet
    prompts: PromptKV
    own: SampleKV  # the generated tokens' keys and values, by slot of the prompts in `prompts`
    layout: DecodeLayout
    row_samples: torch.Tensor  # int64 [padded rows]: the sample of each row (padding rows: any)
    prompt_lengths: torch.Tensor  # int64 [padded rows]: absolute position of generated token 0

    @property
    def padded_rows(self) -> int:
        return self.row_samples.shape[0]

    def live_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of samples not stopped yet, and their sample numbers."""
        live = self.alive.nonzero()[:, 0]
        return live, self.samples[live]


def _pad(values: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    out = torch.full((length,), fill, dtype=values.dtype)
    out[: values.shape[0]] = values
    return out


def _batch(prompt_ids: torch.Tensor, samples: torch.Tensor, prompts: PromptKV, own: SampleKV, n: int,
           lengths: torch.Tensor) -> _Batch:
    padded = max(samples.shape[0], MIN_ROWS)
    slot_of_row = torch.searchsorted(prompt_ids, samples // n) * n + samples % n
    slots = prompt_ids.shape[0] * n
    if padded == slots and samples.shape[0] == slots:  # every slot live, in order: rows are the slots
        layout = DecodeLayout(n=n, slot_rows=None, row_slots=None)
    else:
        slot_rows = torch.zeros(slots, dtype=torch.int64)
        slot_rows[slot_of_row] = torch.arange(samples.shape[0])
        layout = DecodeLayout(n=n, slot_rows=slot_rows, row_slots=_pad(slot_of_row, padded, 0))
    return _Batch(prompt_ids=prompt_ids, samples=samples, alive=torch.ones(samples.shape[0], dtype=torch.bool),
                  prompts=prompts, own=own, layout=layout, row_samples=_pad(samples, padded, 0),
                  prompt_lengths=_pad(lengths[samples // n], padded, 0))


def _should_compact(batch: _Batch, n: int) -> bool:
    live = int(batch.alive.sum())
    if 4 * (batch.padded_rows - max(live, MIN_ROWS)) >= batch.padded_rows:
        return True
    running = torch.unique(batch.samples[batch.alive] // n).shape[0]
    return 4 * (batch.prompt_ids.shape[0] - running) >= batch.prompt_ids.shape[0]


def _compact(batch: _Batch, n: int, lengths: torch.Tensor) -> tuple[_Batch, torch.Tensor]:
    """Drop dead rows and finished prompts; returns the new batch and the old row of each new row."""
    keep = batch.alive.nonzero()[:, 0]
    samples = batch.samples[keep]
    prompt_ids = torch.unique(samples // n)
    old_rows = _pad(keep, max(keep.shape[0], MIN_ROWS), int(keep[0]))  # padding rows copy a live row: finite
    running = torch.searchsorted(batch.prompt_ids, prompt_ids)
    new = _batch(prompt_ids, samples, batch.prompts.select(running), batch.own.select(running), n, lengths)
    return new, old_rows


def _stacked(routes: list[torch.Tensor]) -> torch.Tensor:
    """One forward's routes, [rows, MoE layers, top_k] int32."""
    return torch.stack(routes, dim=1).to(torch.int32)


def generate_group(runner: PackedCausalLM, rope: Rope, prompts: list[list[int]], sampling: SamplingParams,
                   seeds: list[int], stop_ids: tuple[int, ...], record_routes: bool = False,
                   continuation: Continuation | None = None) -> list[Result]:
    """Results for each sample of `prompts`, prompt-major; seeds[prompt * n + i] seeds sample i of the prompt.
    `record_routes`: also return each sample's routed experts (a MoE model's, for routing replay).
    `continuation` (partial rollouts): the samples go on from token `offsets[i]` of their random streams for at
    most `budgets[i]` tokens (a prompt is then the sample's prompt plus what it generated so far, n = 1), and
    stop early, finish reason "abort", when `interrupt()` says so."""
    n = sampling.n
    count = len(prompts) * n
    budgets = torch.tensor(continuation.budgets if continuation else [sampling.max_new_tokens] * count)
    offsets = torch.tensor(continuation.offsets if continuation else [0] * count, dtype=torch.int64)
    interrupt = continuation.interrupt if continuation else None
    max_new = int(budgets.max())
    all_seeds = torch.tensor(seeds, dtype=torch.int64)
    all_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    prompt_kv = runner.allocate_prompts(all_lengths.tolist())
    prompt_routes: list[torch.Tensor] | None = [] if record_routes else None
    prompt_logits = runner.prefill(prompts, prompt_kv, rope, prompt_routes)  # each prompt once, for its n samples
    stop = torch.tensor(stop_ids, dtype=torch.int64)
    tokens_out = torch.zeros(count, max_new, dtype=torch.int64)
    log_probs_out = torch.zeros(count, max_new, dtype=torch.float32)
    generated = budgets.clone()
    stopped = torch.zeros(count, dtype=torch.bool)
    aborted = torch.zeros(count, dtype=torch.bool)
    # routed experts of generated token j (fed at decode step j) of every sample
    routes_out = (torch.zeros(count, max(max_new - 1, 0), runner.moe_layers, runner.top_k, dtype=torch.int32)
                  if record_routes else None)

    delay = float(os.environ.get(SLOW_DECODE_ENV) or 0.0)  # a slow engine, for tests (mppo.trainer.faults)
    samples = torch.arange(count)
    own = runner.allocate_samples(len(prompts), n, max(1, max_new - 1))
    batch = _batch(torch.arange(len(prompts)), samples, prompt_kv, own, n, all_lengths)
    live, live_samples = batch.live_rows()
    logits = prompt_logits[_pad(samples // n, batch.padded_rows, 0)]
    for position in range(max_new):
        with torch._C.DisableTorchFunction():  # CPU tensors only (see PackedCausalLM.prefill)
            if position % UNIFORM_BLOCK == 0:  # [samples, UNIFORM_BLOCK]: the next positions' random numbers
                uniforms = counter_uniforms(all_seeds[:, None],
                                            offsets[:, None] + torch.arange(position, position + UNIFORM_BLOCK))
            tokens, log_probs = choose_tokens(logits, sampling, uniforms[batch.row_samples, position % UNIFORM_BLOCK])
            tokens_out[live_samples, position] = tokens[live]
            log_probs_out[live_samples, position] = log_probs[live]
            if position == max_new - 1:
                break
            hit = torch.isin(tokens[live], stop) if stop.numel() else torch.zeros(live.shape[0], dtype=torch.bool)
            if bool(hit.any()):
                generated[live_samples[hit]] = position + 1
                stopped[live_samples[hit]] = True
            hit |= budgets[live_samples] == position + 1  # a continuation's own budget ("length")
            if interrupt is not None and interrupt():  # new weights: the live samples stop here, to go on later
                generated[live_samples[~hit]] = position + 1
                aborted[live_samples[~hit]] = True
                break
            if bool(hit.any()):
                batch.alive[live[hit]] = False
                if not bool(batch.alive.any()):
                    break
                if _should_compact(batch, n):
                    batch, old_rows = _compact(batch, n, all_lengths)
                    tokens = tokens[old_rows]
                live, live_samples = batch.live_rows()
        if delay:
            time.sleep(delay)
        step_routes: list[torch.Tensor] | None = [] if record_routes else None
        logits = runner.decode(tokens, batch.prompt_lengths + position, batch.prompts, batch.own, position,
                               batch.layout, rope, step_routes)
        if step_routes is not None:
            routes_out[live_samples, position] = _stacked(step_routes)[live]
    token_lists, log_prob_lists = tokens_out.tolist(), log_probs_out.tolist()
    routes = [None] * count
    if record_routes:  # prompt tokens' routes (from the packed prefill rows), then the fed generated tokens'
        packed = _stacked(prompt_routes)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), all_lengths.cumsum(0)]).tolist()
        routes = [torch.cat([packed[starts[i // n]:starts[i // n + 1]], routes_out[i, :length - 1]])
                  for i, length in enumerate(generated.tolist())]
    reasons = ["abort" if abort else "stop" if stop_hit else "length"
               for abort, stop_hit in zip(aborted.tolist(), stopped.tolist())]
    return [(tokens[:length], log_probs[:length], reason, sample_routes)
            for tokens, log_probs, length, reason, sample_routes in zip(token_lists, log_prob_lists,
                                                                        generated.tolist(), reasons, routes)]


def generate(runner: PackedCausalLM, prompts: list[list[int]], sampling: SamplingParams, seeds: list[int],
             stop_ids: tuple[int, ...], record_routes: bool = False,
             continuation: Continuation | None = None) -> list[Result]:
    """generate_group over all prompts, split over one worker per torch intra-op thread (module docstring)."""
    budget = max(continuation.budgets) if continuation else sampling.max_new_tokens
    rope = runner.rope(max(len(p) for p in prompts) + budget)
    threads = torch.get_num_threads()
    workers = min(threads, len(prompts))
    bounds = [len(prompts) * i // workers for i in range(workers + 1)]
    n = sampling.n
    results: list[list[Result] | None] = [None] * workers
    errors: list[BaseException] = []

    def work(index: int) -> None:
        lo, hi = bounds[index], bounds[index + 1]
        try:
            # single-threaded kernels in every worker; OpenMP's thread count is per calling thread, and a new
            # thread starts from OMP_NUM_THREADS (or all cores)
            torch.set_num_threads(1)
            part = None if continuation is None else dataclasses.replace(
                continuation, offsets=continuation.offsets[lo * n:hi * n], budgets=continuation.budgets[lo * n:hi * n])
            results[index] = generate_group(runner, rope, prompts[lo:hi], sampling, seeds[lo * n : hi * n], stop_ids,
                                            record_routes, part)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    try:
        pool = [threading.Thread(target=work, args=(i,), name=f"mppo-rollout-{i}") for i in range(1, workers)]
        for thread in pool:
            thread.start()
        work(0)  # this thread is worker 0
        for thread in pool:
            thread.join()
    finally:
        torch.set_num_threads(threads)
    if errors:
        raise errors[0]
    return [result for group in results for result in group]  # type: ignore[union-attr]
