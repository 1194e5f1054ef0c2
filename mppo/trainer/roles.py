"""The run's models (actor, critic, reference) built from its config, their memory offload around the rollout,
and the rollout engines started after them."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mppo.config import MppoConfig
from mppo.config.decisions import ref_token_budget, uses_critic, uses_reference
from mppo.config.lora import lora_enabled
from mppo.core_algos import RolloutCorrectionParams
from mppo.parallel import ParallelDims
from mppo.parallel.placement import Side
from mppo.rollout.factory import Rollout, build_rollout
from mppo.rollout.remote import RemoteRollout
from mppo.trainer.watchdog import StallWatchdog

if TYPE_CHECKING:  # the workers import megatron: built lazily
    from mppo.workers.actor import ActorWorker
    from mppo.workers.critic import CriticWorker
    from mppo.workers.offload import TrainerStateOffload
    from mppo.workers.reference import ReferenceWorker


class Roles(NamedTuple):
    actor: "ActorWorker"
    critic: "CriticWorker | None"  # None: no critic (critic.enable)
    ref: "ReferenceWorker | None"  # None: no KL term, no reference model
    trainer_state: "TrainerStateOffload"  # what each rollout phase offloads


def build_roles(cfg: MppoConfig, dims: ParallelDims, *, total_steps: int,
                rollout_correction: RolloutCorrectionParams) -> Roles:
    from mppo.workers.actor import ActorWorker
    from mppo.workers.critic import CriticWorker
    from mppo.workers.reference import ReferenceWorker

    arr, n = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n
    actor = ActorWorker(arr.model, arr.actor, dims, arr.model.path, total_steps=total_steps, rollout_n=n,
                        rollout_correction=rollout_correction)
    critic = (CriticWorker(arr.model, cfg.critic, dims, cfg.critic.model.path, total_steps=total_steps, rollout_n=n)
              if uses_critic(cfg) else None)
    ref = (ReferenceWorker(arr.model, arr.ref, dims, arr.model.path, logprob_impl=arr.actor.logprob_impl,
                           kernel_backend=arr.actor.kernel_backend, max_token_len=ref_token_budget(cfg),
                           lora_actor=actor if lora_enabled(cfg) else None)  # LoRA: the actor's base
           if uses_reference(cfg) else None)
    return Roles(actor, critic, ref, _offload(cfg, actor, critic, ref, torch.device(dims.device)))


def _offload(cfg: MppoConfig, actor: Any, critic: Any, ref: Any, device: torch.device) -> "TrainerStateOffload":
    from mppo.workers.offload import TrainerStateOffload

    a = cfg.actor_rollout_ref.actor.megatron
    offload = [("actor", actor.model, actor.optimizer, a.param_offload, a.optimizer_offload)]
    if critic is not None:
        c = cfg.critic.megatron
        offload.append(("critic", critic.model, critic.optimizer, c.param_offload, c.optimizer_offload))
    if ref is not None and not ref.shares_actor:  # a LoRA reference is the actor's model, offloaded with it
        offload.append(("ref", ref.model, None, cfg.actor_rollout_ref.ref.megatron.param_offload, False))
    return TrainerStateOffload(offload, device)


def start_rollout(cfg: MppoConfig, given: Rollout | None, roles: Roles, watchdog: StallWatchdog,
                  run_dir: Path, *, side: Side | None = None) -> Rollout | RemoteRollout:
    """The launch's Rollout: `given` (checked against the config), else engines started now. They start after the
    models, with the state that every rollout phase offloads already offloaded: SGLang sizes its KV cache from the
    memory free at its start, which is then what each rollout phase has. They are released at once, until the
    first weight sync. With `side` (hybrid_engine=false) the engines start on their own ranks (mppo.rollout.remote)."""
    rollout_cfg = cfg.actor_rollout_ref.rollout
    if side is not None:
        with watchdog.phase("start_rollout", 0):
            return RemoteRollout(cfg, side, dtype=roles.actor.dtype)
    if given is not None:
        if (given.name, given.layout.engine_tp) != (rollout_cfg.name, rollout_cfg.tensor_model_parallel_size):
            raise ValueError(f"the Rollout given is {given.name} with engine TP {given.layout.engine_tp}; this "
                             f"config asks for {rollout_cfg.name} with TP {rollout_cfg.tensor_model_parallel_size}")
        return given
    roles.trainer_state.offload()
    with watchdog.phase("start_rollout", 0):
        rollout = build_rollout(cfg, device=roles.trainer_state.device, dtype=roles.actor.dtype,
                                log_dir=run_dir / "rollout")
    roles.trainer_state.reload()
    return rollout
