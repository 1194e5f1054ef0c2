"""`compute_advantage`: one entry point that runs the estimator named by `algorithm.adv_estimator`.

It passes each registered estimator the inputs its signature names (so a new estimator plugs in by name) and
stops with a clear error when one that the estimator requires is missing, e.g. GAE without critic values.
What it passes matches veRL's `ray_trainer.compute_advantage`: GRPO gets `norm_adv_by_std_in_grpo` and the
default epsilon; REINFORCE++ gets `gamma` (veRL: `config.gamma`); pass@k gets the normalisation flag (veRL:
`config["norm_adv_by_std_in_grpo"]`); the optimal-token-baseline estimators get old_log_probs, sum_pi_squared
and rollout_is_weights.
"""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from . import adv_group, adv_otb, adv_token  # noqa: F401  (importing them registers the estimators)
from .adv_registry import get_adv_estimator_fn

__all__ = ["compute_advantage"]

# What each dispatcher input is, for the error when an estimator needs one that was not given.
_INPUT_HINTS: dict[str, str] = {
    "values": "critic values of the responses; this estimator needs a critic (critic.enable / a critic model)",
    "index": "one group id per response (the prompt `uid`), so responses to the same prompt can be compared",
    "reward_baselines": "the reward of a greedy baseline response per prompt (ReMax generates it)",
    "old_log_probs": "the actor's log-probs of the response tokens at rollout time",
    "sum_pi_squared": "sum over the vocabulary of the squared token probabilities at rollout time, per token",
}


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

    One deliberate difference from veRL's trainer: every estimator with a `norm_adv_by_std_in_grpo` parameter gets
    the flag. veRL passes it only to "grpo" (and, via config, to "grpo_passk"), so "grpo_vectorized" there always
    normalises whatever `algorithm.norm_adv_by_std_in_grpo` says; here it follows the setting.

    Raises ValueError for an unknown estimator (listing the valid names) and for a missing required input.
    """
    fn = get_adv_estimator_fn(adv_estimator)
    available: dict[str, Any] = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "values": values,
        "index": index,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "reward_baselines": reward_baselines,
        "old_log_probs": old_log_probs,
        "sum_pi_squared": sum_pi_squared,
        "rollout_is_weights": rollout_is_weights,
    }
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        required = param.default is inspect.Parameter.empty
        value = available.get(name)
        if value is not None:
            kwargs[name] = value
        elif required:
            what = _INPUT_HINTS.get(name, "an input compute_advantage does not provide")
            raise ValueError(f"adv_estimator {adv_estimator!r} needs `{name}` ({what}), but it was not given.")
    return fn(**kwargs)
