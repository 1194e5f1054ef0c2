"""Rule-based rewards (TinyZero countdown and multiplication, GSM8K-style) and the reward manager.

Bottom floor: imports nothing from the rest of mppo. Model output is never evaluated as code: arithmetic goes
through `mppo.rewards.arith`, a bounded parser.
"""
from __future__ import annotations

from mppo.rewards.arith import ParseError, evaluate, parse_and_evaluate
from mppo.rewards.manager import RewardManager
from mppo.rewards.registry import (
    RewardConfigError,
    default_compute_score,
    known_data_sources,
    load_custom_reward_fn,
    resolve_compute_score,
)

__all__ = [
    "ParseError",
    "RewardConfigError",
    "RewardManager",
    "default_compute_score",
    "evaluate",
    "known_data_sources",
    "load_custom_reward_fn",
    "parse_and_evaluate",
    "resolve_compute_score",
]
