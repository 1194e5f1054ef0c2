"""What a config may not do with the separate placement (`actor_rollout_ref.hybrid_engine=false`) and the off-policy
pipeline (`async_training.max_off_policy_steps`); called by mppo.config.validate, so `--dry-run` and `mppo plan`
stop on the same lines."""
from __future__ import annotations

from mppo.config.keys import show
from mppo.config.schema import ConfigError, MppoConfig

K = "async_training.max_off_policy_steps"
HYBRID = "actor_rollout_ref.hybrid_engine"


def is_separate(cfg: MppoConfig) -> bool:
    return not cfg.actor_rollout_ref.hybrid_engine


def engine_world(cfg: MppoConfig) -> int:
    """Engine ranks of a separate placement (0 co-located)."""
    rollout = cfg.actor_rollout_ref.rollout
    return rollout.nnodes * rollout.n_gpus_per_node if is_separate(cfg) else 0


def check_async(cfg: MppoConfig, world_size: int | None) -> tuple[int, str] | None:
    """The off-policy keys on their own, then with hybrid_engine=false the split of the launch: returns the
    trainer's world (what megatron's TP/PP/DP is built over) and how it was found; None co-located."""
    k = cfg.async_training.max_off_policy_steps
    if k < 0:
        raise ConfigError(f"{K} = {show(k)}: must be >= 0 (0: synchronous, 1: one-step off-policy, k: up to k "
                          "steps behind)")
    if cfg.async_training.partial_rollout:
        _check_partial_rollout(cfg, k)
    if k > 0 and not is_separate(cfg):
        raise ConfigError(f"{K} = {k} needs {HYBRID}=false: co-located ranks cannot generate while they train; set "
                          f"{HYBRID}=false with actor_rollout_ref.rollout.n_gpus_per_node engine ranks, or {K}=0")
    if not is_separate(cfg):
        return None
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.enable=true with {HYBRID}=false is not built yet "
                          f"(the agent loop runs beside the trainer); set {HYBRID}=true")
    if k > 0 and cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"algorithm.filter_groups.enable=true with {K} = {k} is not built yet (dynamic sampling "
                          f"draws its further batches on demand); set {K}=0")
    t, r = cfg.trainer, cfg.actor_rollout_ref.rollout
    trainer_world = t.nnodes * t.n_gpus_per_node
    # the node shape the keys describe (the run re-checks it against torchrun's LOCAL_WORLD_SIZE)
    local_world = t.n_gpus_per_node + r.n_gpus_per_node if t.nnodes == r.nnodes else t.n_gpus_per_node
    world = trainer_world + engine_world(cfg) if world_size is None else world_size
    from mppo.parallel.placement import PlacementError, plan_placement  # torch: only for separate placements

    try:
        plan_placement(world, local_world if world % max(local_world, 1) == 0 else world,
                       trainer_nnodes=t.nnodes, trainer_per_node=t.n_gpus_per_node, rollout_nnodes=r.nnodes,
                       rollout_per_node=r.n_gpus_per_node)
    except PlacementError as err:
        raise ConfigError(str(err)) from None
    return trainer_world, (f"the trainer ranks, trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes} x "
                           f"{t.n_gpus_per_node} ({HYBRID}=false)")


def _check_partial_rollout(cfg: MppoConfig, k: int) -> None:
    key = "async_training.partial_rollout"
    if k < 1:
        raise ConfigError(f"{key}=true needs {K} >= 1 (a weight update interrupts a generation running while the "
                          f"trainer updates; at {K} = {k} none does); set {K}=1 with {HYBRID}=false, or {key}=false")
    if cfg.actor_rollout_ref.actor.router_replay.mode == "R3":
        raise ConfigError(f"{key}=true with actor_rollout_ref.actor.router_replay.mode=R3 is not built (a resumed "
                          f"sample's routes would span two versions); set {key}=false or router_replay.mode=disabled")
