"""Decisions that follow from a config alone, shared by the trainer (which acts on them) and `mppo plan` (which
predicts what the trainer will do)."""
from __future__ import annotations

import enum

from mppo.config.schema import MegatronConfig, MppoConfig


class OldLogProbSource(enum.Enum):
    """Where a step's old log-probs (the policy that generated the rollout, for the PPO ratio) come from."""

    ACTOR_PASS = "the actor's log-prob pass before the update"
    UPDATE_FORWARD = "the actor update's forward (on-policy step)"
    ROLLOUT = "the rollout engine (rollout correction bypass mode)"


def off_policy_update(cfg: MppoConfig) -> str:
    """"" when the actor update is on-policy (one epoch over one mini-batch: its forward is the first and only one
    with the weights that generated the rollout), else why not."""
    actor = cfg.actor_rollout_ref.actor
    if actor.ppo_epochs != 1:
        return f"actor.ppo_epochs={actor.ppo_epochs} (later epochs see updated weights)"
    if actor.ppo_mini_batch_size != cfg.data.train_batch_size:
        return (f"{cfg.data.train_batch_size // actor.ppo_mini_batch_size} mini-batches per step (later "
                "mini-batches see updated weights)")
    return ""


def old_log_prob_reuse(cfg: MppoConfig) -> tuple[bool, str]:
    """(True, "") when the actor update may take the old log-probs from its own forward instead of a separate
    pass; else (False, why not). That needs an on-policy update and no use of them before the update."""
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    correction = algo.rollout_correction
    if correction.bypass_mode:
        return False, "algorithm.rollout_correction.bypass_mode=true takes them from the rollout engine"
    if not actor.reuse_on_policy_log_prob:
        return False, "actor.reuse_on_policy_log_prob=false"
    off_policy = off_policy_update(cfg)
    if off_policy:
        return False, off_policy
    if algo.use_kl_in_reward:
        return False, "algorithm.use_kl_in_reward needs them for the rewards, before the update"
    if correction.rollout_is is not None or correction.rollout_rs is not None:
        return False, (f"algorithm.rollout_correction (rollout_is={correction.rollout_is}, "
                       f"rollout_rs={correction.rollout_rs}) needs them for the IS weights and rejection, before "
                       "the update")
    from mppo import core_algos  # lazy: keeps `import mppo.config` free of torch

    if "old_log_probs" in core_algos.estimator_spec(algo.adv_estimator).needs:
        return False, f"adv_estimator {algo.adv_estimator} needs them for the advantages, before the update"
    return True, ""


def old_log_prob_source(cfg: MppoConfig) -> OldLogProbSource:
    """Rollout correction's bypass mode takes the engine's; an update that may reuse its own forward
    (`old_log_prob_reuse`) takes them from it; otherwise a separate forward pass runs before the update."""
    if cfg.algorithm.rollout_correction.bypass_mode:
        return OldLogProbSource.ROLLOUT
    return OldLogProbSource.UPDATE_FORWARD if old_log_prob_reuse(cfg)[0] else OldLogProbSource.ACTOR_PASS


def uses_reference(cfg: MppoConfig) -> bool:
    """Whether the run builds a reference model: for the KL penalty in the reward or the KL loss."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss


def uses_critic(cfg: MppoConfig) -> bool:
    """Whether the run builds a critic (`critic.enable`, which resolution derives from the estimator when null)."""
    return bool(cfg.critic.enable)


def ref_token_budget(cfg: MppoConfig) -> int | None:
    """The reference's token budget per micro-batch: with dynamic batch sizes the actor's (as veRL's ref follows the
    actor's log_prob_use_dynamic_bsz); None: it splits by ref.log_prob_micro_batch_size_per_gpu."""
    actor = cfg.actor_rollout_ref.actor
    return actor.ppo_max_token_len_per_gpu if actor.use_dynamic_bsz else None


def old_log_prob_micro_batch(cfg: MppoConfig) -> int | None:
    """Micro-batch size of the old-log-prob pass: veRL's rollout.log_prob_micro_batch_size_per_gpu; None with
    dynamic batch sizes (the update's token budget)."""
    arr = cfg.actor_rollout_ref
    return None if arr.actor.use_dynamic_bsz else arr.rollout.log_prob_micro_batch_size_per_gpu


def describe_old_log_prob_source(cfg: MppoConfig) -> str | None:
    """The start-up log line when a config asks for a shortcut (actor.reuse_on_policy_log_prob, rollout-correction
    bypass mode): where the old log-probs come from and, when the shortcut does not apply, why; None otherwise."""
    source = old_log_prob_source(cfg)
    if not (cfg.actor_rollout_ref.actor.reuse_on_policy_log_prob or source is OldLogProbSource.ROLLOUT):
        return None
    if source is OldLogProbSource.ACTOR_PASS:
        return f"recomputed before the update: {old_log_prob_reuse(cfg)[1]}"
    return f"from {source.value}"


def uses_sequence_parallel(megatron: MegatronConfig) -> bool:
    """Whether a role's models are built with sequence parallelism: `megatron.sequence_parallel`, where null means
    on iff TP > 1 (veRL's default)."""
    if megatron.sequence_parallel is not None:
        return megatron.sequence_parallel
    return (megatron.tensor_model_parallel_size or 1) > 1


def uses_overlap_grad_reduce(megatron: MegatronConfig, backend: str) -> bool:
    """Whether DDP reduces a role's gradients over DP bucket by bucket while the backward still runs
    (`megatron.overlap_grad_reduce`): null means on iff the backend is NCCL, where the reduction runs on its own
    stream and so overlaps the backward's compute (gloo's collectives run on the host and gain nothing), or when
    `overlap_param_gather=true` asks for it (megatron-core needs it there)."""
    if megatron.overlap_grad_reduce is not None:
        return megatron.overlap_grad_reduce
    return backend == "nccl" or bool(megatron.overlap_param_gather)


def uses_overlap_param_gather(megatron: MegatronConfig, backend: str) -> bool:
    """Whether the distributed optimizer all-gathers a role's updated parameters bucket by bucket in the next
    forward instead of right after its step (`megatron.overlap_param_gather`): null means on iff the backend is
    NCCL and megatron-core can: with the distributed optimizer and overlap_grad_reduce."""
    if megatron.overlap_param_gather is not None:
        return megatron.overlap_param_gather
    return (backend == "nccl" and bool(megatron.use_distributed_optimizer)
            and uses_overlap_grad_reduce(megatron, backend))


def expert_tensor_parallel_size(megatron: MegatronConfig) -> int:
    """Ranks sharding each routed expert of a MoE model (`megatron.expert_tensor_parallel_size`): null means TP,
    megatron-core's default."""
    if megatron.expert_tensor_parallel_size is not None:
        return megatron.expert_tensor_parallel_size
    return megatron.tensor_model_parallel_size or 1
