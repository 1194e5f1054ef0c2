"""The PPO trainer: the fit loop (fit.py) and what a user sees of a run (metrics, checkpoints, validation)."""
from __future__ import annotations

from mppo.config import MppoConfig


def run(cfg: MppoConfig) -> int:
    """Train with `cfg` (entry point of `mppo train`)."""
    from mppo.trainer.fit import run as _run

    return _run(cfg)
