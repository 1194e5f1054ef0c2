"""What `mppo train` rejects before it starts anything, with or without --dry-run, beyond mppo.config.validate
(which checks a config on its own, for any trainer): the trainer runs the same checks first, so a dry run rejects
what the run would. check_config reads only the config and the models' config.json, nothing of this machine: the
trainer's start-up checks (mppo.trainer.components.check_startup) refuse a machine without the run's packages,
while `--dry-run` and `mppo plan` (load_checked with planning=True) only warn, since they are for planning a GPU
run from a login node or a laptop."""
from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from mppo.config import MppoConfig, load_config
from mppo.config.lora import check_lora_model
from mppo.config.validate import check_shared_layout


def load_checked(path: str | None, overrides: list[str], *, world_size: int | None = None,
                 planning: bool = False) -> tuple[MppoConfig, list[str]]:
    """The config of `mppo train` (with or without --dry-run) and of `mppo plan`: loaded, validated and
    check_config'ed (a UserError otherwise), with its warnings, one line each: the config's own and, when
    `planning`, what the run needs that this machine lacks (the rollout engine's package)."""
    from mppo.rollout.factory import rollout_package_warning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(path, overrides, world_size=world_size)
    check_config(cfg)
    notes = [str(w.message) for w in caught]
    if planning and (missing := rollout_package_warning(cfg)) is not None:
        notes.append(missing)
    return cfg, notes


def print_warnings(notes: Sequence[str]) -> None:
    """Each warning once, one line each, on stderr (stdout keeps the config or the plan)."""
    for note in dict.fromkeys(notes):
        print(f"mppo: warning: {note}", file=sys.stderr)


def check_config(cfg: MppoConfig) -> None:
    """One layout for every model, a rollout setup the engine would serve wrong, a model mppo cannot map."""
    from mppo.rollout.factory import check_rollout_config

    check_shared_layout(cfg)
    check_rollout_config(cfg)
    check_models(cfg)


def check_models(cfg: MppoConfig) -> None:
    """Stop at start-up on a model mppo cannot map (an unknown model_type, an unsupported MoE variant such as shared
    experts or another router), and on a model or tokenizer that needs its own code while
    actor_rollout_ref.model.trust_remote_code is false (mppo.models.remote_code): one line naming the file and key,
    before megatron is imported. A model directory without config.json is left to the model loader, which names the
    missing file. The reference policy is the actor's model."""
    from mppo.models.hf_config import read_hf_config
    from mppo.models.remote_code import check_remote_code

    model = cfg.actor_rollout_ref.model
    paths = [model.path] + ([cfg.critic.model.path] if cfg.critic.enable else [])
    for path in dict.fromkeys(p for p in paths if p):
        if (Path(path).expanduser() / "config.json").is_file():
            facts = read_hf_config(Path(path).expanduser())
            if path == model.path:
                check_lora_model(cfg, facts.model_type, facts.is_moe)
    for path in dict.fromkeys(p for p in [*paths, model.tokenizer_path] if p):
        check_remote_code(path, model.trust_remote_code)
