"""Registry of advantage estimators, by the names veRL uses for `algorithm.adv_estimator`.

Every estimator returns `(advantages, returns)`, both `(bs, T)`. The dispatcher `compute_advantage` (in
`advantages.py`) passes each estimator the inputs its signature names, so a new estimator plugs in with
`@register_adv_est("name")` and parameters named after the dispatcher's keywords.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = [
    "AdvantageFn",
    "ADV_ESTIMATOR_REGISTRY",
    "ESTIMATORS_NEEDING_CRITIC",
    "ESTIMATORS_NEEDING_GROUPS",
    "register_adv_est",
    "get_adv_estimator_fn",
]

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageFn] = {}

# Estimators that need critic values (config validation: "gae" without a critic is an error).
ESTIMATORS_NEEDING_CRITIC: frozenset[str] = frozenset({"gae"})
# Estimators that compare responses to the same prompt (index = uid): they need rollout.n > 1 to be meaningful
# ("grpo_passk" raises on groups smaller than 2; the others degrade to a zero or raw-score baseline).
ESTIMATORS_NEEDING_GROUPS: frozenset[str] = frozenset(
    {"grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "opo", "gpg", "grpo_passk", "reinforce_plus_plus_baseline",
     "optimal_token_baseline", "tir_optimal_token_baseline"}
)


def register_adv_est(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under `name`; registering another function under a taken
    name is a ValueError."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"Advantage estimator {name!r} is already registered ({existing.__qualname__}).")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The estimator registered under `name`; ValueError listing the valid names otherwise."""
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; valid names are {sorted(ADV_ESTIMATOR_REGISTRY)}."
        )
    return ADV_ESTIMATOR_REGISTRY[name]
