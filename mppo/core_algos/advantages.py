"""`compute_advantage`: one entry point that runs the estimator named by `algorithm.adv_estimator`.

It passes each registered estimator exactly the inputs it declared (`register_adv_est(needs=, optional=,
params=)`) and stops with a clear error when a needed one is missing, e.g. GAE without critic values. What it
passes matches veRL's `ray_trainer.compute_advantage`: GRPO gets `norm_adv_by_std_in_grpo` and the default
epsilon; REINFORCE++ gets `gamma` (veRL: `config.gamma`); pass@k gets the normalisation flag (veRL:
`config["norm_adv_by_std_in_grpo"]`); the optimal-token-baseline estimators get old_log_probs, sum_pi_squared
and rollout_is_weights; ReMax gets the greedy baselines.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import adv_group, adv_otb, adv_token  # noqa: F401  (importing them registers the estimators)
from .adv_registry import BATCH_INPUTS, estimator_spec

__all__ = ["compute_advantage"]


def compute_advantage(
    adv_estimator: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    index: np.ndarray | list | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as `adv_estimator`; returns `(advantages, returns)`, both `(bs, T)`.

    One deliberate difference from veRL's trainer: every estimator that declares `norm_adv_by_std_in_grpo` gets
    the flag. veRL passes it only to "grpo" (and, via config, to "grpo_passk"), so "grpo_vectorized" there always
    normalises whatever `algorithm.norm_adv_by_std_in_grpo` says; here it follows the setting.

    Raises ValueError for an unknown estimator (listing the valid names) and for a missing needed input.
    """
    spec = estimator_spec(adv_estimator)
    batch: dict[str, Any] = {"values": values, "index": index, "reward_baselines": reward_baselines,
                             "old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared,
                             "rollout_is_weights": rollout_is_weights}
    settings: dict[str, Any] = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo}
    kwargs: dict[str, Any] = {"token_level_rewards": token_level_rewards, "response_mask": response_mask}
    for name in spec.needs:
        if batch[name] is None:
            raise ValueError(f"adv_estimator {adv_estimator!r} needs `{name}` ({BATCH_INPUTS[name]}), but it was "
                             "not given.")
        kwargs[name] = batch[name]
    kwargs.update({name: batch[name] for name in spec.optional if batch[name] is not None})
    kwargs.update({name: settings[name] for name in spec.params})
    return spec.fn(**kwargs)
