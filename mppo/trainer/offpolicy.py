"""The trainer's part of the separate placement and the off-policy pipeline (async_training.max_off_policy_steps).

`start_side` splits the launch (mppo.parallel.placement) before the trainer builds anything; on engine ranks
`run_engine_side` serves the trainer (mppo.rollout.remote) and is all those ranks do. `PipelineMetrics` turns what
each step saw into the `async/` metrics:

    async/staleness/{mean,max}   per sample: the trainer's policy version at the update (steps done) minus the
                                 version of the weights that generated it (0 synchronous, 1 one-step off-policy)
    async/trainer_idle_fraction  share of the step the trainer ranks spent waiting for the engines' responses
    async/engine_idle_fraction   share of the engines' time from the end of their previous generation to the end of
                                 the last one this step collected that they spent waiting for (and loading) weights
                                 or a request (from step 2)
    async/gen_overlap_s          seconds of this step's generation that ran while the previous step updated
                                 (from the end of its generation phase to its end): > 0 is the pipeline at work
    async/partial/resumed_fraction      partial rollouts: share of the batch's responses a weight update
                                        interrupted (they went on on the new weights)
    async/partial/newer_token_fraction  share of the batch's tokens generated on a newer version than their
                                        response's first

A checkpoint keeps the generation in flight (`in_flight_writers`, `restore_in_flight`): at k=1 the checkpoint after
step s is written while the engines generate step s+1 on the weights of version s-1, which the checkpoint does not
hold. Rather than keep those weights too (a second copy of the actor in every checkpoint) and count on the engine
regenerating bit-identically on them (the CPU engine would; SGLang's batching promises no such thing), the
checkpoint waits for that generation (after writing the models, so the engines run meanwhile: the next step would
wait for it anyway) and saves its responses, tokens, log-probs and version: kilobytes. A resumed run trains step s+1
on exactly those, so it continues with the uninterrupted run's metrics.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mppo.config import MppoConfig
from mppo.parallel.placement import ENGINE, Side, init_placement, plan_placement
from mppo.trainer.watchdog import process_group_timeout_s


def start_side(cfg: MppoConfig) -> Side | None:
    """hybrid_engine=false: this rank's side of the split, with its own default process group; None co-located."""
    if cfg.actor_rollout_ref.hybrid_engine:
        return None
    import os

    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    world = int(os.environ["WORLD_SIZE"])
    placement = plan_placement(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), trainer_nnodes=t.nnodes,
                               trainer_per_node=t.n_gpus_per_node, rollout_nnodes=r.nnodes,
                               rollout_per_node=r.n_gpus_per_node)
    return init_placement(placement, timeout_s=process_group_timeout_s(t.collective_timeout_s))


def run_engine_side(cfg: MppoConfig, side: Side) -> int:
    """The engine ranks' program; their machine is checked as the trainer ranks check theirs (mppo.preflight)."""
    from mppo import preflight
    from mppo.rollout.remote import serve_engine

    assert side.role == ENGINE
    preflight.check_run(cfg)
    return serve_engine(cfg, side, run_dir=Path(cfg.trainer.default_local_dir))


log = logging.getLogger("mppo")
IN_FLIGHT = "in_flight"  # the checkpoint part that holds the prefetched generation
_REQUESTS, _RESPONSES = "requests.json", "responses.safetensors"


def in_flight_writers(rollout: Any) -> dict[str, Callable[[Path], None]]:
    """The checkpoint writer of the generation the off-policy pipeline has in flight (none: {}); called on every
    trainer rank (the wait for the engines is collective), rank 0 writes."""
    if not getattr(rollout, "has_prefetched", lambda: False)():
        return {}

    def write(directory: Path) -> None:
        from safetensors.torch import save_file

        from mppo.rollout.factory import pack_responses

        kept = rollout.prefetched()
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        directory.mkdir(parents=True)
        requests, tensors = [], {}
        for i, ((step, first_index, sampling, prompts), responses, record) in enumerate(kept):
            requests.append({"step": step, "first_index": first_index, "sampling": sampling,
                             "prompts": [list(p) for p in prompts], "version": record.version,
                             "start": record.start, "end": record.end})
            tensors.update({f"{i}.{name}": t.contiguous() for name, t in pack_responses(responses).items()})
        save_file(tensors, directory / _RESPONSES)
        (directory / _REQUESTS).write_text(json.dumps(requests))

    return {IN_FLIGHT: write}


def restore_in_flight(rollout: Any, checkpoint: Path) -> int:
    """Hand the generations a checkpoint kept (in_flight_writers) back to the rollout; how many there were."""
    directory = checkpoint / IN_FLIGHT
    if not directory.is_dir():
        return 0
    from safetensors.torch import load_file

    from mppo.rollout.factory import stamp_version, unpack_responses
    from mppo.rollout.remote import GenerationRecord, partial_counts, request_key

    requests, tensors = json.loads((directory / _REQUESTS).read_text()), load_file(directory / _RESPONSES)
    for i, request in enumerate(requests):
        packed = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == str(i)}
        version = request["version"]
        responses = stamp_version(unpack_responses(packed), version)
        record = GenerationRecord(version, request["start"], request["end"], trainer_wait_s=0.0, collected=0.0,
                                  **partial_counts(responses))
        rollout.restore(request_key(request["prompts"], request["sampling"], request["step"],
                                    request["first_index"]), responses, record)
        log.info("restored the generation in flight at the checkpoint: step %d's responses (policy version %d)",
                 request["step"] + 1, version)
    return len(requests)


def prompt_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The prompts' token ids without their left padding."""
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


def partial_rollout_metrics(full: dict[str, torch.Tensor], trainer_version: int) -> dict[str, float]:
    """`async/partial/current_version_probs_diff_max`: over the tokens a partial rollout generated on the weights
    the trainer holds now (`trainer_version`), the largest |p_engine - p_actor| of the sampled token: ~0 when the
    interrupted generations really went on on the new weights. `full`: the global batch's rollout_log_probs,
    old_log_probs, response_mask and rollout_token_versions."""
    current = (full["rollout_token_versions"] == trainer_version) & full["response_mask"].bool()
    if not bool(current.any()):
        return {}
    diff = (full["rollout_log_probs"].double().exp() - full["old_log_probs"].double().exp()).abs()
    return {"async/partial/current_version_probs_diff_max": float(diff[current].max())}


def staleness_metrics(versions: torch.Tensor, trainer_version: int) -> dict[str, float]:
    """`versions`: the policy version of every sample of the global batch."""
    staleness = (trainer_version - versions).to(torch.float64)
    return {"async/staleness/mean": float(staleness.mean().item()), "async/staleness/max": float(staleness.max())}


@dataclass
class PipelineMetrics:
    """The timing side of the async/ metrics, step after step (wall clock: time.time(), which the engine ranks'
    generation intervals also use; one host, or hosts with synchronised clocks)."""

    previous_update: tuple[float, float] | None = None  # the previous step's [end of generation, end]
    previous_gen_end: float | None = None  # when the engines' last generation ended

    def step(self, *, records: list, batch_record, step_start: float, gen_done: float, step_end: float
             ) -> dict[str, float]:
        """`records`: the generations collected during the step, in order (RemoteRollout.take_records);
        `batch_record`: the one that produced the step's training batch."""
        waited = sum(r.trainer_wait_s for r in records if r.collected >= step_start)  # not validation's, before
        metrics = {"async/trainer_idle_fraction": waited / max(step_end - step_start, 1e-9)}
        idle = cycle = 0.0
        for record in records:
            if self.previous_gen_end is not None:
                idle += max(record.start - self.previous_gen_end, 0.0)
                cycle += record.end - self.previous_gen_end
            self.previous_gen_end = record.end
        if cycle > 0:
            metrics["async/engine_idle_fraction"] = idle / cycle
        if batch_record is not None and batch_record.responses:  # partial rollouts
            metrics["async/partial/resumed_fraction"] = batch_record.resumed / batch_record.responses
            metrics["async/partial/newer_token_fraction"] = batch_record.newer_tokens / max(batch_record.tokens, 1)
        if batch_record is not None:
            overlap = 0.0
            if self.previous_update is not None:
                lo = max(batch_record.start, self.previous_update[0])
                overlap = max(min(batch_record.end, self.previous_update[1]) - lo, 0.0)
            metrics["async/gen_overlap_s"] = overlap
        self.previous_update = (gen_done, step_end)
        return metrics
