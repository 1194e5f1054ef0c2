"""What `mppo train` rejects before it starts anything, with or without --dry-run, beyond mppo.config.validate
(which checks a config on its own, for any trainer): the trainer runs the same checks first, so a dry run rejects
what the run would. Reads only the config and the models' config.json: nothing of this machine (its GPUs and
packages are the trainer's start-up checks, mppo.trainer.components.check_startup)."""
from __future__ import annotations

from pathlib import Path

from mppo.config import MppoConfig
from mppo.config.validate import check_shared_layout


def check_config(cfg: MppoConfig) -> None:
    """One layout for every model, the rollout's setup (the engine's package), a model mppo cannot map."""
    from mppo.rollout.factory import check_rollout_setup

    check_shared_layout(cfg)
    check_rollout_setup(cfg)
    check_models(cfg)


def check_models(cfg: MppoConfig) -> None:
    """Stop at start-up on a model mppo cannot map (an unknown model_type, an unsupported MoE variant such as shared
    experts or another router): one line naming the config.json key, before megatron is imported. A model directory
    without config.json is left to the model loader, which names the missing file."""
    from mppo.models.hf_config import read_hf_config

    paths = [cfg.actor_rollout_ref.model.path] + ([cfg.critic.model.path] if cfg.critic.enable else [])
    for path in dict.fromkeys(p for p in paths if p):
        if (Path(path).expanduser() / "config.json").is_file():
            read_hf_config(Path(path).expanduser())
