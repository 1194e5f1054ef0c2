"""Who provides each batch input an advantage estimator declares (`needs`, mppo.core_algos.register_adv_est).

Most come from what the config builds, and mppo.config.validate refuses a config that would not produce one:
`values` from the critic, `old_log_probs` and `sum_pi_squared` from the actor's log-prob pass, `index` is the
prompt's uid. What an estimator alone needs is produced by its input provider, which runs with the reward of every
generation batch (so dynamic sampling's further batches get it too): ReMax's greedy baselines.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mppo.trainer import remax

# batch input -> the provider class; built with the fit loop's rollout_batch, reward and training sampling
REWARD_STAGE_PROVIDERS: dict[str, Callable] = {"reward_baselines": remax.GreedyBaselines}


def reward_stage_providers(needs: tuple[str, ...], **fit_loop: Any) -> list[Callable]:
    """The providers of what `needs` (an estimator's declaration) asks of each generation batch, in that order."""
    return [REWARD_STAGE_PROVIDERS[name](**fit_loop) for name in needs if name in REWARD_STAGE_PROVIDERS]
