"""Fault injection for reliability tests: `MPPO_FAULT` makes ranks die, hang or see a NaN loss at a chosen point.

    MPPO_FAULT=kill@step:2:phase:update_actor      SIGKILL every rank as it enters update_actor in step 2
    MPPO_FAULT=kill@step:2:phase:gen:rank:1        the same, on rank 1 only (torchrun then stops the others)
    MPPO_FAULT=kill@checkpoint:after:actor         SIGKILL mid-checkpoint: the actor's part written, the rest not
    MPPO_FAULT=hang@step:1:phase:gen               sleep forever inside the phase (the stall watchdog must end it)
    MPPO_FAULT=nan_loss@step:1                     NaN advantages and returns: the actor's and critic's losses are NaN
    MPPO_FAULT="nan_loss@step:1;nan_loss@step:3+"  several faults, separated by ';'. `N+` is step N and every later one

    MPPO_FAULT_SLOW_DECODE_S=0.05                  every decode step of the CPU engine sleeps 50 ms first: a slow
                                                   engine (the partial-rollout tests: an update that lands mid-generation)

Steps count as in metrics.jsonl (the first training step is 1); a fault without `step:` fires at every step.
Checkpoint points are `after:<part>` (actor, critic) and `before:rename` (everything written, manifest included).
The variable is read once at start-up; unset, the trainer holds no injector and its hooks cost nothing.
"""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass

import torch

from mppo.errors import UserError
from mppo.trainer.hooks import StepHook

ENV_VAR = "MPPO_FAULT"
KINDS = ("kill", "hang", "nan_loss")
# The fit loop's phases (timing_s/<phase> in the metrics) plus the non-step ones the watchdog also covers.
PHASES = ("step", "weight_sync", "gen", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
          "metrics", "validate", "save_checkpoint", "load_checkpoint")
CHECKPOINT_POINTS = ("after:actor", "after:critic", "before:rename")


class FaultSpecError(UserError, ValueError):
    """MPPO_FAULT does not parse; the message shows the grammar."""


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | hang | nan_loss
    step: int | None = None  # None: every step
    from_step: bool = False  # `step:N+`: step N and every later one
    phase: str | None = None
    checkpoint: str | None = None  # e.g. "after:actor"
    rank: int | None = None  # None: every rank

    def matches_step(self, step: int) -> bool:
        if self.step is None:
            return True
        return step >= self.step if self.from_step else step == self.step

    def describe(self, step: int) -> str:
        where = f"phase {self.phase}" if self.phase else f"checkpoint {self.checkpoint}" if self.checkpoint else ""
        return f"{self.kind} at step {step} {where}".strip()


_GRAMMAR = ("expected KIND@key:value[:key:value...] with KIND in kill|hang|nan_loss and keys step:N (or N+), "
            f"phase:NAME ({'|'.join(PHASES)}), checkpoint:POINT ({'|'.join(CHECKPOINT_POINTS)}), rank:R; "
            "several faults separated by ';'")


def parse(spec: str) -> list[Fault]:
    """The faults of an MPPO_FAULT value; raises FaultSpecError naming the bad part."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        kind, _, rest = part.partition("@")
        if kind not in KINDS:
            raise FaultSpecError(f"{ENV_VAR}={spec!r}: unknown fault kind {kind!r}; {_GRAMMAR}")
        tokens = rest.split(":") if rest else []
        fields: dict[str, object] = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            width = 2 if key == "checkpoint" else 1  # a checkpoint point itself has a colon: after:actor
            value = ":".join(tokens[i + 1:i + 1 + width])
            if len(tokens) < i + 1 + width or not value:
                raise FaultSpecError(f"{ENV_VAR}={spec!r}: key {key!r} has no value; {_GRAMMAR}")
            fields.update(_field(spec, key, value))
            i += 1 + width
        fault = Fault(kind, **fields)  # type: ignore[arg-type]
        if kind == "nan_loss" and (fault.phase or fault.checkpoint):
            raise FaultSpecError(f"{ENV_VAR}={spec!r}: nan_loss fires before the updates; give it only step/rank")
        if kind in ("kill", "hang") and not (fault.phase or fault.checkpoint):
            raise FaultSpecError(f"{ENV_VAR}={spec!r}: {kind} needs phase:NAME or checkpoint:POINT; {_GRAMMAR}")
        faults.append(fault)
    return faults


def _field(spec: str, key: str, value: str) -> dict[str, object]:
    try:
        if key == "step":
            return {"step": int(value.rstrip("+")), "from_step": value.endswith("+")}
        if key == "rank":
            return {"rank": int(value)}
    except ValueError:
        raise FaultSpecError(f"{ENV_VAR}={spec!r}: {key}:{value} is not a number; {_GRAMMAR}") from None
    if key == "phase" and value in PHASES:
        return {"phase": value}
    if key == "checkpoint" and value in CHECKPOINT_POINTS:
        return {"checkpoint": value}
    raise FaultSpecError(f"{ENV_VAR}={spec!r}: bad {key}:{value}; {_GRAMMAR}")


def _say(rank: int, text: str) -> None:
    # os.write, not logging: a SIGKILL follows at once and must not wait for (or lose) a buffered handler
    os.write(2, f"mppo: fault injection [rank {rank}]: {text}\n".encode())


class FaultInjector(StepHook):
    """The faults of this rank, a step hook of the fit loop: at phase entries, checkpoint points and updates."""

    def __init__(self, faults: list[Fault], rank: int) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]

    def on_phase(self, name: str, step: int) -> None:
        for fault in self.faults:
            if fault.phase == name and fault.matches_step(step):
                self._fire(fault, step)

    def at_checkpoint(self, step: int, point: str) -> None:
        for fault in self.faults:
            if fault.checkpoint == point and fault.matches_step(step):
                self._fire(fault, step)

    def before_update(self, step: int, batch: dict[str, torch.Tensor], data: dict[str, torch.Tensor]) -> None:
        """nan_loss: NaN advantages (actor loss) and returns (critic loss), as a bad batch would give."""
        if any(f.kind == "nan_loss" and f.matches_step(step) for f in self.faults):
            _say(self.rank, f"nan_loss at step {step}")
            for key in ("advantages", "returns"):
                batch[key] = torch.full_like(batch[key], math.nan)  # new tensors: the step's data metrics stay real

    def _fire(self, fault: Fault, step: int) -> None:
        _say(self.rank, fault.describe(step))
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while fault.kind == "hang":
            time.sleep(3600)


def from_env() -> FaultInjector | None:
    """The injector for this rank (torchrun's RANK) from MPPO_FAULT, or None when it is unset or empty."""
    spec = os.environ.get(ENV_VAR, "").strip()
    if not spec:
        return None
    return FaultInjector(parse(spec), rank=int(os.environ.get("RANK", "0")))
