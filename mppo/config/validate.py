"""Checks of a typed config that types alone cannot express: choices, ranges, parallel layout, batch arithmetic.

Each failure is one ConfigError naming the key, what is wrong and how to fix it. Things that are legal but
almost surely unintended are ConfigWarnings. Whether data files or model directories exist is left to the data
loader and model builder (they report it with the file name); where a model's config.json is there, the
sequence lengths are checked against its position limit.
"""
from __future__ import annotations

import difflib
import json
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

from mppo.config.keys import get_key, schema_leaves, show
from mppo.config.lora import check_lora
from mppo.config.resolve import resolve
from mppo.config.schema import ACTOR, ConfigError, MppoConfig
from mppo.config.validate_async import check_async, is_separate

ROLLOUT = "actor_rollout_ref.rollout"
REF = "actor_rollout_ref.ref"


class ConfigWarning(UserWarning):
    """A legal config that is almost surely not what the user meant."""


def _fail(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"{key} = {show(value)}: {problem}; {fix}")


# --------------------------------------------------------------------------------------------------------- choices
def _check_choice(key: str, value: Any, allowed: Iterable[str], what: str) -> None:
    allowed = sorted(str(a) for a in allowed)
    for item in value if isinstance(value, list) else [value]:
        if item not in allowed:
            near = difflib.get_close_matches(str(item), allowed, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise ConfigError(f"{key} = {item!r} is not a known {what}{hint}; choose one of: {', '.join(allowed)}")


def _check_choices(cfg: MppoConfig) -> None:
    for key, leaf in schema_leaves().items():
        value = get_key(cfg, key)
        if leaf.choices and value is not None:
            _check_choice(key, value, leaf.choices, "value")
    from mppo.core_algos import (  # lazy: core_algos imports torch
        ADV_ESTIMATOR_REGISTRY, AGG_LOSS_MODES, KL_PENALTY_TYPES, POLICY_LOSS_REGISTRY)

    _check_choice("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADV_ESTIMATOR_REGISTRY,
                  "advantage estimator")
    _check_choice(f"{ACTOR}.policy_loss.loss_mode", cfg.actor_rollout_ref.actor.policy_loss.loss_mode,
                  POLICY_LOSS_REGISTRY, "policy loss mode")
    _check_choice(f"{ACTOR}.loss_agg_mode", cfg.actor_rollout_ref.actor.loss_agg_mode, AGG_LOSS_MODES,
                  "loss aggregation mode")
    _check_choice("critic.loss_agg_mode", cfg.critic.loss_agg_mode, AGG_LOSS_MODES, "loss aggregation mode")
    _check_choice(f"{ACTOR}.kl_loss_type", cfg.actor_rollout_ref.actor.kl_loss_type, KL_PENALTY_TYPES,
                  "KL estimator")
    _check_choice("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_PENALTY_TYPES, "KL estimator")


# ---------------------------------------------------------------------------------------------------------- ranges
def _at_least(lo: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= lo), f"must be >= {lo}"


def _above(lo: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v > lo), f"must be > {lo}"


def _fraction(lo_open: bool) -> tuple[Callable[[Any], bool], str]:
    if lo_open:
        return (lambda v: 0 < v <= 1), "must be in (0, 1]"
    return (lambda v: 0 <= v <= 1), "must be in [0, 1]"


_MINUS_ONE_OR_POSITIVE = ((lambda v: v == -1 or v >= 1), "must be -1 (off) or >= 1")
_ROLES_MEGATRON = [f"{r}.megatron" for r in (ACTOR, REF, "critic")]
_OPTIMS = [f"{ACTOR}.optim", "critic.optim"]

# (keys, (predicate, problem)); a null value is skipped here (non-Optional keys cannot be null after loading).
_RANGES: list[tuple[list[str], tuple[Callable[[Any], bool], str]]] = [
    (["data.train_batch_size", "data.gen_batch_size", "data.val_batch_size", "data.max_prompt_length",
      "data.max_response_length", f"{ROLLOUT}.multi_turn.max_assistant_turns",
      f"{ROLLOUT}.multi_turn.max_tool_response_length", f"{ROLLOUT}.multi_turn.tool_max_memory_mb",
      f"{ACTOR}.ppo_mini_batch_size", f"{ACTOR}.ppo_micro_batch_size_per_gpu", f"{ACTOR}.ppo_max_token_len_per_gpu",
      f"{ACTOR}.ppo_epochs", f"{ROLLOUT}.n", f"{ROLLOUT}.tensor_model_parallel_size",
      f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", f"{ROLLOUT}.weight_bucket_mb", f"{ROLLOUT}.val_kwargs.n",
      f"{REF}.log_prob_micro_batch_size_per_gpu", "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu",
      "critic.ppo_max_token_len_per_gpu", "critic.ppo_epochs", "algorithm.kl_ctrl.horizon", "trainer.total_epochs",
      "trainer.total_training_steps", "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.max_ckpt_to_keep",
      "trainer.collective_timeout_s"]
     + [f"{m}.{k}" for m in _ROLES_MEGATRON for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                       "virtual_pipeline_model_parallel_size",
                                                       "expert_model_parallel_size", "expert_tensor_parallel_size")],
     _at_least(1)),
    ([f"{o}.{k}" for o in _OPTIMS for k in ("weight_decay", "clip_grad")]
     + [f"{ACTOR}.kl_loss_coef", "algorithm.kl_ctrl.kl_coef", f"{ROLLOUT}.val_kwargs.temperature",
        "trainer.critic_warmup", "trainer.max_consecutive_skips", "reward.max_failed_steps"]
     + [f"{m}.override_transformer_config.{k}" for m in _ROLES_MEGATRON
        for k in ("moe_aux_loss_coeff", "moe_z_loss_coeff")], _at_least(0)),
    ([f"{o}.{k}" for o in _OPTIMS for k in ("lr", "eps")] + [f"{ACTOR}.clip_ratio", f"{ACTOR}.clip_ratio_low", f"{ACTOR}.clip_ratio_high",
                                      "critic.cliprange_value", "algorithm.kl_ctrl.target_kl",
                                      f"{ROLLOUT}.temperature", f"{ROLLOUT}.multi_turn.tool_timeout_s"], _above(0)),
    ([f"{ACTOR}.tau_pos", f"{ACTOR}.tau_neg", f"{ACTOR}.policy_loss.dro_beta"], _above(0)),
    ([f"{ACTOR}.policy_loss.clip_cov_ratio", f"{ACTOR}.policy_loss.kl_cov_ratio"], _fraction(lo_open=False)),
    ([f"{ACTOR}.clip_ratio_c"], ((lambda v: v > 1), "must be > 1 (dual-clip lower bound on -A x ratio)")),
    ([f"{o}.{k}" for o in _OPTIMS for k in ("lr_warmup_steps_ratio", "min_lr_ratio")]
     + ["algorithm.gamma", "algorithm.lam"], _fraction(lo_open=False)),
    ([f"{ROLLOUT}.top_p", f"{ROLLOUT}.val_kwargs.top_p", f"{ROLLOUT}.gpu_memory_utilization"], _fraction(True)),
    ([f"{o}.lr_warmup_steps" for o in _OPTIMS], ((lambda v: v >= -1), "must be -1 (use the ratio) or >= 0")),
    ([f"{ROLLOUT}.top_k", f"{ROLLOUT}.val_kwargs.top_k", "trainer.save_freq", "trainer.test_freq"],
     _MINUS_ONE_OR_POSITIVE),
]


def _check_ranges(cfg: MppoConfig) -> None:
    for keys, (ok, problem) in _RANGES:
        for key in keys:
            value = get_key(cfg, key)
            if value is not None and not ok(value):
                raise ConfigError(f"{key} = {show(value)}: {problem}")
    for opt in _OPTIMS:
        betas = get_key(cfg, f"{opt}.betas")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise _fail(f"{opt}.betas", betas, "Adam needs two betas in [0, 1)", "e.g. [0.9, 0.999]")
    for m in _ROLES_MEGATRON:
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                  "use_distributed_optimizer", "recompute", "seed"):
            if get_key(cfg, f"{m}.{k}") is None:
                raise ConfigError(f"{m}.{k} is null; set it (only the critic's and ref's may be null: "
                                  f"they then take the actor's)")


# ---------------------------------------------------------------------------------------------------------- layout
def _world(cfg: MppoConfig, world_size: int | None) -> tuple[int, str]:
    separate = check_async(cfg, world_size)  # hybrid_engine=false: the trainer's share of the launch
    if separate is not None:
        return separate
    t = cfg.trainer
    planned = t.nnodes * t.n_gpus_per_node
    if world_size is None:
        return planned, f"trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes} x {t.n_gpus_per_node}"
    if world_size != planned:
        per_node = f"trainer.n_gpus_per_node={world_size // t.nnodes}" if world_size % t.nnodes == 0 else \
            f"trainer.nnodes=1 trainer.n_gpus_per_node={world_size}"
        raise ConfigError(f"the launch has {world_size} ranks (WORLD_SIZE) but trainer.nnodes x "
                          f"trainer.n_gpus_per_node = {t.nnodes} x {t.n_gpus_per_node} = {planned}; "
                          f"set them to match the launch, e.g. {per_node}")
    return world_size, f"WORLD_SIZE = {world_size}"


SHARED_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                      "expert_tensor_parallel_size", "context_parallel_size")


def check_shared_layout(cfg: MppoConfig) -> None:
    """Actor, critic and reference share megatron's one set of process groups, so they share one layout (for the
    critic and reference even when they are not built); checked after each role's layout on its own."""
    from mppo.config.decisions import expert_tensor_parallel_size

    def value(section, key: str):  # expert-TP null means TP, which is shared already
        return expert_tensor_parallel_size(section) if key == "expert_tensor_parallel_size" else getattr(section, key)

    actor = cfg.actor_rollout_ref.actor.megatron
    for role, section in (("critic", cfg.critic.megatron), (REF, cfg.actor_rollout_ref.ref.megatron)):
        for key in SHARED_LAYOUT_KEYS:
            if value(section, key) != value(actor, key):
                raise ConfigError(f"{role}.megatron.{key}={value(section, key)} differs from the actor's "
                                  f"{value(actor, key)}; mppo runs all models on one layout: leave it null")


# MegatronConfig keys the reference shares with the trainable roles but has no use for: it has no optimizer, and
# the model-parallel RNG (init, dropout) is seeded once per process, from the actor's seed.
REF_INERT_KEYS = ("seed", "use_distributed_optimizer", "optimizer_offload", "overlap_grad_reduce",
                  "overlap_param_gather")


def _check_overlap(cfg: MppoConfig) -> None:
    """megatron-core's requirements of overlap_param_gather (Megatron-LM's validate_args asserts the same): it
    all-gathers the distributed optimizer's shards, bucket by bucket in the order overlap_grad_reduce made."""
    for m in (f"{ACTOR}.megatron", "critic.megatron"):
        if not get_key(cfg, f"{m}.overlap_param_gather"):
            continue
        if not get_key(cfg, f"{m}.use_distributed_optimizer"):
            raise _fail(f"{m}.overlap_param_gather", True, "it overlaps the distributed optimizer's parameter "
                        "all-gather, and use_distributed_optimizer is false",
                        f"set {m}.use_distributed_optimizer=true, or overlap_param_gather=false (or null)")
        if get_key(cfg, f"{m}.overlap_grad_reduce") is False:
            raise _fail(f"{m}.overlap_param_gather", True, "megatron-core overlaps the parameter all-gather only "
                        "with overlap_grad_reduce, which is false", f"set {m}.overlap_grad_reduce=true (or null), "
                        "or overlap_param_gather=false (or null)")


def _warn_inert_ref_keys(cfg: MppoConfig) -> None:
    actor, ref = cfg.actor_rollout_ref.actor.megatron, cfg.actor_rollout_ref.ref.megatron
    for key in REF_INERT_KEYS:
        if getattr(ref, key) != getattr(actor, key):  # resolved: it differs only when set
            warnings.warn(f"{REF}.megatron.{key} = {show(getattr(ref, key))} does nothing: the reference policy never "
                          "trains (no optimizer; the model-parallel RNG is seeded from the actor's seed); leave it "
                          "null", ConfigWarning, 3)


def _data_parallel_size(cfg: MppoConfig, role: str, world: int, world_text: str) -> int:
    """DP of `role` after checking that its TP x PP x CP layout fits the world and EP divides DP."""
    m = f"{role}.megatron"
    tp, pp = get_key(cfg, f"{m}.tensor_model_parallel_size"), get_key(cfg, f"{m}.pipeline_model_parallel_size")
    cp = get_key(cfg, f"{m}.context_parallel_size")
    if cp < 1:
        raise _fail(f"{m}.context_parallel_size", cp, "must be >= 1", "use 1 (no context parallelism) or more")
    if cp == 1 and world % (tp * pp):
        raise ConfigError(f"{m}: TP x PP = {tp} x {pp} = {tp * pp} does not divide the world size {world} "
                          f"({world_text}); choose tensor/pipeline sizes whose product divides {world}")
    if world % (tp * pp * cp):
        raise _fail(f"{m}.context_parallel_size", cp, f"TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp} does not "
                    f"divide the world size {world} ({world_text})", f"choose sizes whose product divides {world}")
    vpp = get_key(cfg, f"{m}.virtual_pipeline_model_parallel_size")
    if vpp is not None and pp < 2:
        raise _fail(f"{m}.virtual_pipeline_model_parallel_size", vpp, "interleaving needs pipeline parallelism",
                    f"set {m}.pipeline_model_parallel_size > 1 or virtual_pipeline_model_parallel_size=null")
    if get_key(cfg, f"{m}.sequence_parallel") and tp < 2:
        raise _fail(f"{m}.sequence_parallel", True, "sequence parallelism splits the sequence over the TP ranks, and "
                    "TP is 1", f"set {m}.tensor_model_parallel_size > 1, or sequence_parallel=null (on iff TP > 1)")
    dp, ep = world // (tp * pp * cp), get_key(cfg, f"{m}.expert_model_parallel_size")
    if cp > 1 and ep > 1:
        raise _fail(f"{m}.context_parallel_size", cp, f"context parallelism is not supported with expert parallelism "
                    f"(expert_model_parallel_size = {ep}; MoE models run at CP 1)", f"set {m}.context_parallel_size=1")
    if cp > 1 and cfg.actor_rollout_ref.model.transformer_impl == "local":
        raise _fail(f"{m}.context_parallel_size", cp, "megatron's local attention (transformer_impl=local) has no "
                    "context parallelism", "use actor_rollout_ref.model.transformer_impl=auto, sdpa or te")
    etp = get_key(cfg, f"{m}.expert_tensor_parallel_size")
    if etp is None or etp == tp:
        if dp % ep:  # megatron takes the EP ranks from the data-parallel ones
            raise _fail(f"{m}.expert_model_parallel_size", ep, f"the experts are split over data-parallel ranks, and "
                        f"DP = world {world} / (TP x PP = {tp * pp}) = {dp} is not a multiple of it",
                        f"use a divisor of {dp}: {_divisors(dp)}")
    else:
        _check_expert_tensor_parallel(m, tp, etp, ep, stage_ranks=world // pp)
    return dp


def _check_expert_tensor_parallel(m: str, tp: int, etp: int, ep: int, *, stage_ranks: int) -> None:
    """An expert-TP other than TP: megatron lays the experts out as ETP x EP x expert-DP over each stage's ranks,
    and mppo's HF export needs each ETP x EP block (one set of experts) to hold whole TP groups
    (mppo.parallel.state.check_layout says the same at start-up)."""
    key, block = f"{m}.expert_tensor_parallel_size", etp * ep
    if stage_ranks % block:
        raise _fail(key, etp, f"ETP x EP = {etp} x {ep} = {block} does not divide the {stage_ranks} ranks of a "
                    "pipeline stage", f"choose ETP and EP whose product divides {stage_ranks}, or ETP=null (= TP)")
    if block % tp:
        raise _fail(key, etp, f"ETP x EP = {etp} x {ep} = {block} is not a multiple of TP = {tp}: each block of ranks "
                    "holding one set of experts must hold whole TP groups (mppo's HF export)",
                    f"raise {m}.expert_model_parallel_size, or ETP=null (= TP)")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_batches(cfg: MppoConfig, role: str, dp: int) -> None:
    """veRL semantics: a mini-batch counts prompts; with n samples each it holds mini x n samples over DP ranks."""
    tbs, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    mini, micro = get_key(cfg, f"{role}.ppo_mini_batch_size"), get_key(cfg, f"{role}.ppo_micro_batch_size_per_gpu")
    if mini > tbs:
        raise _fail(f"{role}.ppo_mini_batch_size", mini, f"larger than data.train_batch_size = {tbs}",
                    f"use at most {tbs}")
    if tbs % mini:
        raise _fail(f"{role}.ppo_mini_batch_size", mini, f"does not divide data.train_batch_size = {tbs} into whole "
                    "mini-batches", f"use a divisor of {tbs}: {_divisors(tbs)}")
    samples = mini * n
    if samples % dp:
        raise _fail(f"{role}.ppo_mini_batch_size", mini, f"a mini-batch of {mini} x rollout.n {n} = {samples} samples "
                    f"does not split over DP = {dp} ranks", f"make ppo_mini_batch_size x rollout.n a multiple of {dp}")
    per_rank = samples // dp
    if get_key(cfg, f"{role}.use_dynamic_bsz"):
        budget = get_key(cfg, f"{role}.ppo_max_token_len_per_gpu")
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        if budget < longest:
            raise _fail(f"{role}.ppo_max_token_len_per_gpu", budget, f"a single sequence can have {longest} tokens "
                        "(max_prompt_length + max_response_length)", f"set it to at least {longest}")
    elif per_rank % micro:
        raise _fail(f"{role}.ppo_micro_batch_size_per_gpu", micro, f"does not divide the {per_rank} samples per DP "
                    f"rank of a mini-batch ({mini} prompts x n {n} / DP {dp})", f"use a divisor of {per_rank}: "
                    f"{_divisors(per_rank)}")


def _check_log_prob_batches(cfg: MppoConfig, key: str, dp: int) -> None:
    if cfg.actor_rollout_ref.actor.use_dynamic_bsz:
        return
    per_rank = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n // dp
    micro = get_key(cfg, key)
    if per_rank % micro:
        raise _fail(key, micro, f"does not divide the {per_rank} samples per DP rank of a step "
                    f"(train_batch_size x n / DP {dp})", f"use a divisor of {per_rank}: {_divisors(per_rank)}")


# ------------------------------------------------------------------------------------------------------- algorithm
def _missing_estimator_input(cfg: MppoConfig, name: str) -> ConfigError | None:
    """Why the trainer, as configured, would not produce the estimator input `name`; None when it would.
    (reward_baselines: the trainer generates ReMax's greedy rollout; old_log_probs: always there.)"""
    alg, rollout = cfg.algorithm, cfg.actor_rollout_ref.rollout
    needed_by = f"algorithm.adv_estimator = '{alg.adv_estimator}' needs"
    if name == "values" and not cfg.critic.enable:
        return _fail("critic.enable", cfg.critic.enable, f"{needed_by} a critic's values",
                     "set critic.enable=true (or null), or use an estimator without values (grpo)")
    # A group of one has no baseline: GRPO would silently become unbaselined REINFORCE and RLOO the raw score.
    if name == "index" and rollout.n < 2:
        return _fail(f"{ROLLOUT}.n", rollout.n, f"{needed_by} groups: it compares the responses of one prompt and "
                     "needs at least 2 of them", f"set {ROLLOUT}.n >= 2 (e.g. 5)")
    if name == "sum_pi_squared":
        if not cfg.actor_rollout_ref.actor.calculate_sum_pi_squared:
            return _fail(f"{ACTOR}.calculate_sum_pi_squared", False, f"{needed_by} sum_pi_squared from the actor's "
                         "log-prob pass", "set it to true (or null)")
        if alg.rollout_correction.bypass_mode:
            return _fail(f"{RC}.bypass_mode", True, f"{needed_by} sum_pi_squared from the actor's log-prob pass, "
                         "which bypass mode skips (old log-probs come from the engine)", "set bypass_mode=false")
    return None


def _check_algorithm(cfg: MppoConfig) -> None:
    from mppo.core_algos import estimator_spec

    alg, actor, rollout = cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    spec = estimator_spec(alg.adv_estimator)
    for name in spec.needs:
        error = _missing_estimator_input(cfg, name)
        if error is not None:
            raise error
    if cfg.critic.enable and "values" not in spec.needs:
        warnings.warn(f"critic.enable = true but algorithm.adv_estimator = '{alg.adv_estimator}' does not use "
                      "values: the critic would train for nothing; set critic.enable=null", ConfigWarning, 3)
    loss = actor.policy_loss
    if loss.loss_mode == "dro" and loss.dro_beta is None:
        raise _fail(f"{ACTOR}.policy_loss.dro_beta", None, "loss_mode 'dro' needs its penalty weight",
                    "set it > 0, e.g. 0.1")
    if loss.clip_cov_lb >= loss.clip_cov_ub:
        raise _fail(f"{ACTOR}.policy_loss.clip_cov_lb", loss.clip_cov_lb, f"not below clip_cov_ub = "
                    f"{loss.clip_cov_ub}", "make the lower bound smaller than the upper")
    # veRL only warns; penalising the same KL twice is never what a recipe means, and the fix is one key.
    if alg.use_kl_in_reward and actor.use_kl_loss:
        raise ConfigError("algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss are both true: the KL "
                          "to the reference would be penalised twice; set one of them to false")
    if cfg.trainer.critic_warmup > 0 and not cfg.critic.enable:
        raise _fail("trainer.critic_warmup", cfg.trainer.critic_warmup, "there is no critic to warm up",
                    "set trainer.critic_warmup=0")
    if cfg.actor_rollout_ref.model.transformer_impl == "te" and cfg.trainer.device == "cpu":
        raise _fail("actor_rollout_ref.model.transformer_impl", "te", "Transformer Engine needs CUDA but "
                    "trainer.device = 'cpu'", "use transformer_impl=auto or sdpa (fused attention on CPU), or "
                    "transformer_impl=local")
    val = rollout.val_kwargs
    if val.n > 1 and not val.do_sample:
        warnings.warn(f"{ROLLOUT}.val_kwargs.n = {val.n} with do_sample = false gives {val.n} identical greedy "
                      "responses; set val_kwargs.do_sample=true or val_kwargs.n=1", ConfigWarning, 3)


# --------------------------------------------------------------------------------------------------------- rollout
def _check_rollout_layout(cfg: MppoConfig) -> None:
    """Rollout groups are `rollout.tensor_model_parallel_size` consecutive ranks of one node (mppo.rollout.factory);
    the world is nnodes x n_gpus_per_node (checked by _world), so groups that divide a node divide the world."""
    rollout, n_per_node = cfg.actor_rollout_ref.rollout, cfg.trainer.n_gpus_per_node
    per_node_key = "trainer.n_gpus_per_node"
    if is_separate(cfg):  # engines live on the engine ranks of a node
        n_per_node, per_node_key = rollout.n_gpus_per_node, f"{ROLLOUT}.n_gpus_per_node"
    tp, key = rollout.tensor_model_parallel_size, f"{ROLLOUT}.tensor_model_parallel_size"
    if rollout.name == "cpu" and tp != 1:
        raise _fail(key, tp, "the CPU engine has no tensor parallelism (every rank runs one engine and generates "
                    "its share of the prompts)", "set it to 1")
    if n_per_node % tp:
        raise _fail(key, tp, f"an engine must live within one node of {n_per_node} ranks ({per_node_key})",
                    f"use a divisor of {n_per_node}")


# ------------------------------------------------------------------------------------------------ dynamic sampling
def _check_dynamic_sampling(cfg: MppoConfig, dp: int) -> None:
    fg, tbs, gen = cfg.algorithm.filter_groups, cfg.data.train_batch_size, cfg.data.gen_batch_size
    if not fg.enable:
        if gen is not None and gen != tbs:
            raise _fail("data.gen_batch_size", gen, f"differs from data.train_batch_size = {tbs} without dynamic "
                        "sampling, which alone draws several generation batches per step",
                        "set algorithm.filter_groups.enable=true or data.gen_batch_size=null")
        return
    if cfg.actor_rollout_ref.rollout.n < 2:
        raise _fail(f"{ROLLOUT}.n", cfg.actor_rollout_ref.rollout.n, "algorithm.filter_groups drops groups whose "
                    "responses all score the same, and a group of one is never dropped", f"set {ROLLOUT}.n >= 2")
    _check_filter_metric(cfg)
    gen = tbs if gen is None else gen
    # A step that reaches max_num_gen_batches is filled with filtered groups: one generation batch must be enough.
    if gen < tbs:
        raise _fail("data.gen_batch_size", gen, f"smaller than data.train_batch_size = {tbs}",
                    f"use at least {tbs} (DAPO recipes use about 3x)")
    if gen % dp:
        raise _fail("data.gen_batch_size", gen, f"does not split over the {dp} data-parallel ranks",
                    f"use a multiple of {dp}")


def _check_filter_metric(cfg: MppoConfig) -> None:
    """What the metric needs that the config can tell (mppo.trainer.dynamic_sampling says what each one is); a
    user function's return is known only when it runs: the first step stops on a key it does not return."""
    key, metric = "algorithm.filter_groups.metric", cfg.algorithm.filter_groups.metric
    if metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise _fail(key, metric, "the reward after the in-reward KL penalty needs the reference log-probs, which "
                    "are computed after filtering, for the kept groups only",
                    "use metric=seq_reward (the score before KL), or algorithm.use_kl_in_reward=false")
    if metric == "score" and not cfg.reward.custom_fn.path:
        raise _fail(key, metric, "the built-in reward functions return a number, which counts as 'acc' (no "
                    "'score' key of a dict return)", "use metric=acc or metric=reward, or a reward.custom_fn "
                    "that returns {'score': ...}")


def _check_overlong_buffer(cfg: MppoConfig) -> None:
    kw = cfg.reward.reward_kwargs
    buffer = kw.overlong_buffer_cfg
    if buffer.enable and not 0 < buffer.len <= kw.max_resp_len:
        raise _fail("reward.reward_kwargs.overlong_buffer_cfg.len", buffer.len, f"must be in 1..max_resp_len = "
                    f"{kw.max_resp_len} (the penalty ramps over the last len tokens)",
                    f"use e.g. {max(1, kw.max_resp_len // 4)}, or set enable=false")


# ---------------------------------------------------------------------------------------------- rollout correction
RC = "algorithm.rollout_correction"


def _check_rollout_correction(cfg: MppoConfig) -> None:
    """Choices and thresholds of algorithm.rollout_correction, parsed by the same code that uses them."""
    from mppo.core_algos import (  # lazy: core_algos imports torch
        ROLLOUT_IS_LEVELS, ROLLOUT_LOSS_TYPES, ROLLOUT_RS_OPTIONS, parse_rollout_is_threshold,
        parse_rollout_rs_thresholds)

    rc, loss_mode = cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.rollout_is is not None:
        _check_choice(f"{RC}.rollout_is", rc.rollout_is, ROLLOUT_IS_LEVELS, "IS level (or null: off)")
    _check_choice(f"{RC}.loss_type", rc.loss_type, ROLLOUT_LOSS_TYPES, "bypass-mode loss type")
    try:
        parse_rollout_is_threshold(rc.rollout_is_threshold)
    except (TypeError, ValueError) as err:
        raise _fail(f"{RC}.rollout_is_threshold", rc.rollout_is_threshold, str(err).rstrip("."),
                    "give a number (TIS upper bound, e.g. 2.0) or 'lower_upper' (IcePop, e.g. '0.5_5.0')") from None
    if rc.rollout_rs is not None:
        options = [o.strip() for o in rc.rollout_rs.split(",") if o.strip()]
        if not options:
            raise _fail(f"{RC}.rollout_rs", rc.rollout_rs, "names no criterion", "use null (off) or e.g. 'seq_mean_k3'")
        _check_choice(f"{RC}.rollout_rs", options, ROLLOUT_RS_OPTIONS, "rejection criterion")
        if rc.rollout_rs_threshold is None:
            raise _fail(f"{RC}.rollout_rs_threshold", None, f"rollout_rs = '{rc.rollout_rs}' needs its threshold",
                        "set one value, or one per criterion (comma separated; k1 criteria: 'lower_upper')")
        try:
            parse_rollout_rs_thresholds(list(dict.fromkeys(options)), rc.rollout_rs_threshold)
        except (TypeError, ValueError) as err:
            raise _fail(f"{RC}.rollout_rs_threshold", rc.rollout_rs_threshold, str(err).rstrip("."),
                        "k2/k3 criteria take one positive bound, k1 ones ratio bounds 'lower_upper' "
                        "(e.g. '0.5_2.0')") from None
    if rc.bypass_mode and loss_mode != "vanilla":
        raise _fail(f"{RC}.bypass_mode", True, f"bypass mode has its own loss ({RC}.loss_type), so "
                    f"actor.policy_loss.loss_mode = '{loss_mode}' would be ignored",
                    "set actor_rollout_ref.actor.policy_loss.loss_mode=vanilla, or bypass_mode=false")
    if rc.bypass_mode and rc.rollout_is_batch_normalize:
        raise _fail(f"{RC}.rollout_is_batch_normalize", True, "bypass mode computes the IS weights inside each "
                    "micro-batch's loss, where a batch mean would depend on the micro-batch split",
                    "set it to false, or bypass_mode=false (then the mean is over the global batch)")
    if not rc.bypass_mode and rc.loss_type != "ppo_clip":
        warnings.warn(f"{RC}.loss_type = '{rc.loss_type}' only applies with {RC}.bypass_mode=true; the actor uses "
                      "actor.policy_loss.loss_mode", ConfigWarning, 3)


# ------------------------------------------------------------------------------------------------- model limits
def _model_config(model_path: str) -> dict | None:
    """The model's config.json; None when there is none to read (the model loader reports a missing or broken
    model directory with its own message)."""
    try:
        config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _max_positions(model_path: str) -> int | None:
    limit = (_model_config(model_path) or {}).get("max_position_embeddings")
    return limit if isinstance(limit, int) else None


def check_expert_parallel(cfg: MppoConfig) -> None:
    """Each role's expert_model_parallel_size must divide its model's routed experts (a dense model: 1)."""
    roles = [(ACTOR, cfg.actor_rollout_ref.model.path), (REF, cfg.actor_rollout_ref.model.path)]
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.model.path))
    for role, path in roles:
        key = f"{role}.megatron.expert_model_parallel_size"
        ep, config = get_key(cfg, key), _model_config(path) if path else None
        if config is None or ep == 1:
            continue
        experts = config.get("num_experts") or config.get("num_local_experts")
        if not experts:
            raise _fail(key, ep, f"the model at {path!r} is dense ({config.get('model_type')}, no routed experts)",
                        "set it to 1")
        if experts % ep:
            raise _fail(key, ep, f"does not divide the {experts} experts of the model at {path!r}",
                        f"use a divisor of {experts} that divides DP: {_divisors(experts)}")


def check_router_replay(cfg: MppoConfig) -> None:
    """Routing replay (R3) needs a MoE model and a rollout whose every routed token the engine ran itself (both
    engines, CPU and SGLang, record their routes: docs/MOE.md)."""
    key = f"{ACTOR}.router_replay.mode"
    mode, rollout = get_key(cfg, key), cfg.actor_rollout_ref.rollout
    if mode == "disabled":
        return
    unsupported = [
        (rollout.multi_turn.enable, "rollout.multi_turn.enable=true: tool-response tokens have no engine routes"),
        (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=true: dynamic sampling's batch "
                                             "concatenation does not carry routes"),
        (get_key(cfg, f"{ACTOR}.megatron.recompute") != "none", "megatron.recompute: recomputed forwards in the "
                                                                  "backward would route anew"),
    ]
    for bad, why in unsupported:
        if bad:
            raise _fail(key, mode, f"not supported with {why}", f"set {key}=disabled")
    config = _model_config(cfg.actor_rollout_ref.model.path) if cfg.actor_rollout_ref.model.path else None
    if config is not None and not (config.get("num_experts") or config.get("num_local_experts")):
        raise _fail(key, mode, f"the model is dense ({config.get('model_type')}): there are no routes to replay",
                    f"set {key}=disabled")


def check_model_limits(cfg: MppoConfig) -> None:
    """A prompt + response sequence must fit the positions of every model that reads it (actor, critic): rotary
    embeddings beyond max_position_embeddings are outside what the model was trained for, and the CPU engine
    refuses them mid-run. Models whose config.json is not at hand are skipped."""
    prompt, response = cfg.data.max_prompt_length, cfg.data.max_response_length
    models = [("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)]
    if cfg.critic.enable:
        models.append(("critic.model.path", cfg.critic.model.path))
    checked = set()
    for key, path in models:
        if not path or path in checked:
            continue
        checked.add(path)
        limit = _max_positions(path)
        if limit is not None and prompt + response > limit:
            fix = (f"lower data.max_response_length to at most {limit - prompt}" if prompt < limit
                   else "lower data.max_prompt_length and data.max_response_length")
            raise ConfigError(f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = "
                              f"{prompt + response} tokens, more than the model's max_position_embeddings = {limit} "
                              f"({key}={path!r}); {fix}, or use a model with more positions")


# ------------------------------------------------------------------------------------------------------ public API
def validate(cfg: MppoConfig, world_size: int | None = None) -> None:
    """Raise ConfigError for the first problem found; warn (ConfigWarning) for legal but suspicious settings.

    `world_size`: ranks of the actual launch (torchrun's WORLD_SIZE); None: trainer.nnodes x n_gpus_per_node.
    Inherited nulls are resolved first (on a copy), so a hand-built MppoConfig can be validated too.
    """
    cfg = resolve(cfg)
    _check_choices(cfg)
    _check_ranges(cfg)
    check_lora(cfg)
    _check_algorithm(cfg)
    _check_rollout_correction(cfg)
    world, world_text = _world(cfg, world_size)
    _check_rollout_layout(cfg)
    _warn_inert_ref_keys(cfg)
    _check_overlap(cfg)
    actor_dp = _data_parallel_size(cfg, ACTOR, world, world_text)
    _check_batches(cfg, ACTOR, actor_dp)
    _check_dynamic_sampling(cfg, actor_dp)
    _check_overlong_buffer(cfg)
    _check_log_prob_batches(cfg, f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", actor_dp)
    if cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss:
        _check_log_prob_batches(cfg, f"{REF}.log_prob_micro_batch_size_per_gpu",
                                _data_parallel_size(cfg, REF, world, world_text))
    if cfg.critic.enable:
        _check_batches(cfg, "critic", _data_parallel_size(cfg, "critic", world, world_text))
    check_shared_layout(cfg)
    check_model_limits(cfg)
    check_expert_parallel(cfg)
    check_router_replay(cfg)
