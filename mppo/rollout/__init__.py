"""Rollout: the engine interface, a CPU engine (tests, demo) and the SGLang engine (GPU, imported lazily)."""
from __future__ import annotations

from mppo.rollout.base import (
    RolloutEngine,
    RolloutResponse,
    RolloutStateError,
    SamplingParams,
    WeightStream,
    iter_weight_buckets,
)
from mppo.rollout.seeding import sample_seed

__all__ = [
    "RolloutEngine",
    "RolloutResponse",
    "RolloutStateError",
    "SamplingParams",
    "WeightStream",
    "iter_weight_buckets",
    "sample_seed",
]
