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
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

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
    from mppo.rollout.remote import serve_engine

    assert side.role == ENGINE
    return serve_engine(cfg, side, run_dir=Path(cfg.trainer.default_local_dir))


def prompt_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """The prompts' token ids without their left padding."""
    return [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]


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
        if batch_record is not None:
            overlap = 0.0
            if self.previous_update is not None:
                lo = max(batch_record.start, self.previous_update[0])
                overlap = max(min(batch_record.end, self.previous_update[1]) - lo, 0.0)
            metrics["async/gen_overlap_s"] = overlap
        self.previous_update = (gen_done, step_end)
        return metrics
