"""Decisions that follow from a config alone, shared by the trainer (which acts on them) and `mppo plan` (which
predicts what the trainer will do)."""
from __future__ import annotations

import inspect

from mppo.config.schema import MppoConfig


def old_log_prob_reuse(cfg: MppoConfig) -> tuple[bool, str]:
    """(True, "") when the actor update may take the old log-probs from its own forward instead of a separate
    pass; else (False, why not). That needs an on-policy update (one epoch over one mini-batch: its forward is
    the first and only one with the weights that generated the rollout) and no use of them before the update."""
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    if not actor.reuse_on_policy_log_prob:
        return False, "actor.reuse_on_policy_log_prob=false"
    if actor.ppo_epochs != 1:
        return False, f"actor.ppo_epochs={actor.ppo_epochs} (later epochs see updated weights)"
    if actor.ppo_mini_batch_size != cfg.data.train_batch_size:
        return False, (f"{cfg.data.train_batch_size // actor.ppo_mini_batch_size} mini-batches per step (later "
                       "mini-batches see updated weights)")
    if algo.use_kl_in_reward:
        return False, "algorithm.use_kl_in_reward needs them for the rewards, before the update"
    from mppo import core_algos  # lazy: keeps `import mppo.config` free of torch

    estimator = core_algos.get_adv_estimator_fn(algo.adv_estimator)
    if "old_log_probs" in inspect.signature(estimator).parameters:
        return False, f"adv_estimator {algo.adv_estimator} needs them for the advantages, before the update"
    return True, ""
