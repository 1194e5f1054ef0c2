"""Step hooks: what the fit loop runs at fixed points of a step besides the PPO math, so that train_step shows the
seed's steps and nothing else. Two exist: the generation dump (trainer.rollout_data_dir, `GenerationDump`) and
fault injection for the reliability tests (MPPO_FAULT, mppo.trainer.faults.FaultInjector). A hook implements the
points it needs; the others do nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from mppo.trainer.rollout_dump import DUMP_INPUTS, dump_generations

log = logging.getLogger("mppo")

Batch = dict[str, torch.Tensor]


class StepHook:
    """The points of a step a hook may act at (steps count as in metrics.jsonl: the first training step is 1)."""

    phase: str | None = None  # the timed phase its before_update runs in (timing_s/<phase>); None: untimed

    def on_phase(self, name: str, step: int) -> None:
        """A phase of the step (mppo.trainer.faults.PHASES) is starting."""

    def before_update(self, step: int, batch: Batch, data: Batch) -> None:
        """Advantages are computed, the updates come next. `batch`: this rank's rows (a hook may replace its
        tensors); `data`: the global batch's metric inputs, gathered before any hook ran. Collective: every rank
        calls it."""

    def at_checkpoint(self, step: int, point: str) -> None:
        """The checkpoint of `step` reached `point` (mppo.trainer.faults.CHECKPOINT_POINTS)."""


class StepHooks:
    """The run's hooks, each called in order at each point."""

    def __init__(self, hooks: Sequence[StepHook]) -> None:
        self.hooks = list(hooks)

    def __iter__(self):
        return iter(self.hooks)

    def on_phase(self, name: str, step: int) -> None:
        for hook in self.hooks:
            hook.on_phase(name, step)

    def checkpoint_points(self, step: int) -> Callable[[str], None] | None:
        """The `fault_hook` of CheckpointManager.save for `step` (None without hooks)."""
        if not self.hooks:
            return None

        def at_point(point: str) -> None:
            for hook in self.hooks:
                hook.at_checkpoint(step, point)
        return at_point


class GenerationDump(StepHook):
    """trainer.rollout_data_dir: each step's generations as JSON lines, `<dir>/<step>.jsonl`, written by rank 0."""

    phase = "dump_generations"

    def __init__(self, out_dir: str | Path, tokenizer: Any, *, is_main: bool,
                 gather_global: Callable[[Batch, tuple[str, ...]], Batch]) -> None:
        self.out_dir, self.tokenizer, self.is_main, self.gather_global = Path(out_dir), tokenizer, is_main, \
            gather_global

    def before_update(self, step: int, batch: Batch, data: Batch) -> None:
        """Only the part of DUMP_INPUTS that `data` lacks is gathered (a collective)."""
        full = {**data, **self.gather_global(batch, tuple(k for k in DUMP_INPUTS if k not in data))}
        if not self.is_main:
            return
        try:
            dump_generations(self.out_dir, step, full, self.tokenizer)
        except OSError as e:  # a full disk or a bad path costs the dump, not the run (the other ranks wait on us)
            log.warning("step %d: could not write generations to %s (trainer.rollout_data_dir): %s", step,
                        self.out_dir, e)
            return
        if step == 1:
            log.info("generations of each step go to %s (trainer.rollout_data_dir)", self.out_dir)
