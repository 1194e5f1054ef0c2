"""Which checkpoints a run may resume: its checkpoint manager, keyed by what the run computes (the config less the
keys a resumed run may change, and the models' architecture)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from mppo.config import MppoConfig
from mppo.parallel import ParallelDims
from mppo.trainer.checkpoint import CheckpointInfo, CheckpointManager
from mppo.models.hf_config import model_facts

# Keys a resumed run may change without changing what it computes.
RESUME_FREE = ("trainer.total_epochs", "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq",
               "trainer.logger", "trainer.max_ckpt_to_keep", "trainer.collective_timeout_s",
               "trainer.val_before_train", "trainer.project_name", "trainer.experiment_name",
               "trainer.resume_mode", "trainer.max_consecutive_skips", "trainer.default_local_dir", "reward.max_failed_steps",
               "trainer.rollout_data_dir",
               "data.val_files", "data.val_batch_size", "actor_rollout_ref.actor.reuse_on_policy_log_prob",
               # where memory goes around the rollout (the engine's share; offloads restore bitwise): what a run
               # that ran out of memory changes before it resumes
               "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.free_cache_engine",
               *(f"{role}.megatron.{key}" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
                 for key in ("param_offload", "optimizer_offload")))


def open_checkpoints(cfg: MppoConfig, dims: ParallelDims) -> tuple[CheckpointManager, CheckpointInfo | None]:
    """The run's checkpoint manager (partial writes of a killed run removed) and the checkpoint to resume (None:
    a fresh start). A checkpoint of another model or config stops the run here, before the models are built."""
    ckpt = CheckpointManager(Path(cfg.trainer.default_local_dir), resume_config=resume_config(cfg),
                             layout={"tp": dims.tp, "pp": dims.pp, "dp": dims.dp, "vpp": dims.vpp, "ep": dims.ep},
                             max_to_keep=cfg.trainer.max_ckpt_to_keep)
    ckpt.remove_partial_writes()
    return ckpt, (ckpt.latest() if cfg.trainer.resume_mode != "disable" else None)


def resume_config(cfg: MppoConfig) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = value

    walk("", asdict(cfg))
    # The models' architecture too: another model put at the same path must not resume this run's checkpoint.
    models = {"actor_rollout_ref.model": cfg.actor_rollout_ref.model.path}
    if cfg.critic.enable:
        models["critic.model"] = cfg.critic.model.path or cfg.actor_rollout_ref.model.path
    for prefix, path in models.items():
        flat.update({f"{prefix}.config_json.{k}": v for k, v in model_facts(path).items()})
    return {k: v for k, v in flat.items()
            if not any(k == free or k.startswith(free + ".") for free in RESUME_FREE)
            and ".val_kwargs." not in k}
