"""Structured configuration of an mppo run (typed dataclasses + omegaconf), veRL/TinyZero key names.

How a config is built, in order (`load_config`):
1. Defaults: the dataclasses in `mppo.config.schema` (`configs/ppo_trainer.yaml` is the same defaults written out
   with a comment per key; a test keeps the two equal).
2. A YAML file, if given, merged over the defaults. Recipes in `configs/` contain only the keys they change; there
   is no `defaults:` list or file inheritance: every file is read on top of the dataclass defaults.
3. Dotted `key=value` overrides from the command line, as in veRL/Hydra (`actor_rollout_ref.actor.optim.lr=1e-6`,
   `trainer.logger=[console,wandb]`); values are parsed as YAML. A single string given to a list key becomes a
   one-item list (`data.train_files=train.parquet`).
4. omegaconf interpolations are resolved (`${trainer.project_name}`, `${oc.env:RUN_DIR,runs/demo}`).
5. Inherited nulls are filled (`resolve`): a key listed in `schema.INHERITED_FROM` that is null takes its parent's
   value, e.g. `critic.ppo_mini_batch_size` the actor's, `critic.megatron.*` and `actor_rollout_ref.ref.megatron.*`
   the actor's layout, `data.seed` the trainer's. `critic.enable: null` becomes true iff the advantage estimator
   needs values (`core_algos.ESTIMATORS_NEEDING_CRITIC`).
6. `validate(cfg, world_size)`: choices (estimators, loss modes, aggregation modes and KL types come from
   `mppo.core_algos`' registries), ranges, parallel layout against the world size, batch-size arithmetic, and
   max_prompt_length + max_response_length against the model's max_position_embeddings (from its config.json).

Every mistake is a `ConfigError` whose message is the one line the user sees (key, problem, fix). The result is a
plain `MppoConfig` dataclass tree (no omegaconf objects): `cfg.actor_rollout_ref.actor.optim.lr`.
"""
from __future__ import annotations

from mppo.config.keys import get_key
from mppo.config.loader import config_hash, load_config, parse_override, to_yaml
from mppo.config.resolve import resolve
from mppo.config.schema import (
    ActorConfig, ActorRolloutRefConfig, AlgorithmConfig, ConfigError, CriticConfig, DataConfig, KLControlConfig,
    MegatronConfig, ModelConfig, MppoConfig, OptimConfig, RefConfig, RewardConfig, RolloutConfig, SamplingConfig,
    TrainerConfig)
from mppo.config.validate import ConfigWarning, validate

__all__ = [
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "ConfigError", "ConfigWarning", "CriticConfig",
    "DataConfig", "KLControlConfig", "MegatronConfig", "ModelConfig", "MppoConfig", "OptimConfig", "RefConfig",
    "RewardConfig", "RolloutConfig", "SamplingConfig", "TrainerConfig", "config_hash", "get_key", "load_config",
    "parse_override", "resolve", "to_yaml", "validate",
]
