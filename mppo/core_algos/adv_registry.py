"""Registry of advantage estimators, by the names veRL uses for `algorithm.adv_estimator`, with what each needs.

Every estimator returns `(advantages, returns)`, both `(bs, T)`, and always gets `token_level_rewards` and
`response_mask`. Everything else is declared when it is registered:

    @register_adv_est("remax", needs=("reward_baselines",))

- `needs`: batch inputs the estimator cannot run without (BATCH_INPUTS); config validation rejects a run whose
  trainer would not produce one (e.g. "values" without a critic) and the trainer builds exactly these;
- `optional`: batch inputs passed when the run has them (the OTB estimators take rollout IS weights);
- `params`: algorithm settings passed from the config (ALGORITHM_PARAMS).

The dispatcher `compute_advantage` passes exactly the declared names, nothing found by looking at signatures.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "AdvantageFn",
    "ADV_ESTIMATOR_REGISTRY",
    "ALGORITHM_PARAMS",
    "BATCH_INPUTS",
    "EstimatorSpec",
    "estimator_spec",
    "estimators_needing",
    "register_adv_est",
    "get_adv_estimator_fn",
]

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# What each declarable batch input is (also the error text when one is missing).
BATCH_INPUTS: dict[str, str] = {
    "values": "critic values of the responses; this estimator needs a critic (critic.enable / a critic model)",
    "index": "one group id per response (the prompt `uid`), so responses to the same prompt can be compared",
    "reward_baselines": "the reward of a greedy baseline response per prompt (ReMax generates it)",
    "old_log_probs": "the actor's log-probs of the response tokens at rollout time",
    "sum_pi_squared": "sum over the vocabulary of the squared token probabilities at rollout time, per token "
                      "(actor.calculate_sum_pi_squared)",
    "rollout_is_weights": "rollout correction's importance-sampling weights (algorithm.rollout_correction)",
}
# Algorithm settings an estimator may declare, as `algorithm.<name>`.
ALGORITHM_PARAMS: frozenset[str] = frozenset({"gamma", "lam", "norm_adv_by_std_in_grpo"})


@dataclass(frozen=True)
class EstimatorSpec:
    """An estimator and the inputs it declared."""

    fn: AdvantageFn
    needs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    params: tuple[str, ...] = ()


ADV_ESTIMATOR_REGISTRY: dict[str, EstimatorSpec] = {}


def register_adv_est(name: str, *, needs: tuple[str, ...] = (), optional: tuple[str, ...] = (),
                     params: tuple[str, ...] = ()) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under `name` with its declared inputs.

    ValueError for another function under a taken name, an undeclarable input or setting, or a declared name the
    function does not take as a parameter (a typo would otherwise surface only at step 1)."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(name)
        if existing is not None and existing.fn is not fn:
            raise ValueError(f"Advantage estimator {name!r} is already registered ({existing.fn.__qualname__}).")
        unknown = [k for k in (*needs, *optional) if k not in BATCH_INPUTS]
        unknown += [k for k in params if k not in ALGORITHM_PARAMS]
        if unknown:
            raise ValueError(f"Advantage estimator {name!r} declares unknown inputs {unknown}; batch inputs are "
                             f"{sorted(BATCH_INPUTS)}, settings {sorted(ALGORITHM_PARAMS)}.")
        accepted = inspect.signature(fn).parameters
        missing = [k for k in ("token_level_rewards", "response_mask", *needs, *optional, *params)
                   if k not in accepted]
        if missing:
            raise ValueError(f"Advantage estimator {name!r} declares {missing}, which {fn.__qualname__} does not "
                             "take as parameters.")
        ADV_ESTIMATOR_REGISTRY[name] = EstimatorSpec(fn, tuple(needs), tuple(optional), tuple(params))
        return fn

    return decorator


def estimator_spec(name: str) -> EstimatorSpec:
    """The registration of `name`; ValueError listing the valid names otherwise."""
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; valid names are {sorted(ADV_ESTIMATOR_REGISTRY)}."
        )
    return ADV_ESTIMATOR_REGISTRY[name]


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The estimator function registered under `name`; ValueError listing the valid names otherwise."""
    return estimator_spec(name).fn


def estimators_needing(batch_input: str) -> frozenset[str]:
    """Names of the registered estimators that declared `batch_input` in `needs`."""
    return frozenset(name for name, spec in ADV_ESTIMATOR_REGISTRY.items() if batch_input in spec.needs)
