"""Resolution: the inherited nulls of a config filled from their parent keys (schema.INHERITED_FROM), and the
keys whose default follows from the advantage estimator."""
from __future__ import annotations

import copy
from typing import Any

from mppo.config.keys import get_key, set_key
from mppo.config.schema import INHERITED_FROM, MppoConfig


def resolve(cfg: MppoConfig) -> MppoConfig:
    """A copy with every inherited null filled from its parent key and critic.enable decided.

    Virtual pipeline size 1 is normalised to null (both mean no interleaving), so workers see null or >= 2.
    """
    cfg = copy.deepcopy(cfg)

    def fill(key: str) -> Any:
        value = get_key(cfg, key)
        if value is None and key in INHERITED_FROM:
            value = fill(INHERITED_FROM[key])
            set_key(cfg, key, value)
        return value

    for key in INHERITED_FROM:
        fill(key)
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"):
        if get_key(cfg, f"{role}.megatron.virtual_pipeline_model_parallel_size") == 1:
            set_key(cfg, f"{role}.megatron.virtual_pipeline_model_parallel_size", None)
    from mppo.core_algos import estimators_needing  # lazy: keeps `import mppo.config` light

    if cfg.critic.enable is None:
        cfg.critic.enable = cfg.algorithm.adv_estimator in estimators_needing("values")
    actor = cfg.actor_rollout_ref.actor
    if actor.calculate_sum_pi_squared is None:
        actor.calculate_sum_pi_squared = cfg.algorithm.adv_estimator in estimators_needing("sum_pi_squared")
    return cfg
