"""mppo.config: defaults, YAML + override loading, inheritance, validation errors, hashing."""
from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from pathlib import Path

import pytest
import yaml

from mppo.config import ConfigError, ConfigWarning, MppoConfig, config_hash, load_config, to_yaml, validate
from mppo.config.loader import schema_leaves

REPO = Path(__file__).resolve().parent.parent
DEFAULTS_YAML = REPO / "configs" / "ppo_trainer.yaml"
ACTOR = "actor_rollout_ref.actor"


def load(*overrides: str, path: str | Path | None = None, world_size: int | None = None) -> MppoConfig:
    return load_config(None if path is None else str(path), list(overrides), world_size=world_size)


def error_of(*overrides: str, path: str | Path | None = None, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, path=path, world_size=world_size)
    message = str(info.value)
    assert "\n" not in message, "a user error is one line"
    return message


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------------- defaults
def test_defaults_yaml_mirrors_dataclass_defaults():
    from_yaml = yaml.safe_load(DEFAULTS_YAML.read_text())
    assert from_yaml == dataclasses.asdict(MppoConfig())


def test_defaults_yaml_has_a_comment_on_every_key():
    for number, line in enumerate(DEFAULTS_YAML.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            assert re.search(r"\S.*:.*#\s*\S", line), f"ppo_trainer.yaml line {number} has no comment: {line!r}"


def test_loading_the_defaults_file_changes_nothing():
    assert load(path=DEFAULTS_YAML) == load()


# Defaults copied by hand from veRL's _generated_ppo_megatron_trainer.yaml (0.9 line), for the keys both have.
VERL_DEFAULTS = {
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 512,
    "data.prompt_key": "prompt", "data.filter_overlong_prompts": False, "data.shuffle": True,
    f"{ACTOR}.optim.lr": 1e-6, f"{ACTOR}.optim.weight_decay": 0.01, f"{ACTOR}.optim.betas": [0.9, 0.999],
    f"{ACTOR}.optim.clip_grad": 1.0, f"{ACTOR}.optim.lr_warmup_steps": -1, f"{ACTOR}.optim.lr_warmup_steps_ratio": 0.0,
    f"{ACTOR}.ppo_mini_batch_size": 256, f"{ACTOR}.use_dynamic_bsz": False, f"{ACTOR}.ppo_max_token_len_per_gpu": 16384,
    f"{ACTOR}.clip_ratio": 0.2, f"{ACTOR}.clip_ratio_low": 0.2, f"{ACTOR}.clip_ratio_high": 0.2,
    f"{ACTOR}.clip_ratio_c": 3.0, f"{ACTOR}.loss_agg_mode": "token-mean", f"{ACTOR}.policy_loss.loss_mode": "vanilla",
    f"{ACTOR}.policy_loss.clip_cov_ratio": 0.0002, f"{ACTOR}.policy_loss.clip_cov_lb": 1.0,
    f"{ACTOR}.policy_loss.clip_cov_ub": 5.0, f"{ACTOR}.policy_loss.kl_cov_ratio": 0.0002,
    f"{ACTOR}.policy_loss.ppo_kl_coef": 0.1, f"{ACTOR}.entropy_coeff": 0, f"{ACTOR}.use_kl_loss": False,
    f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "low_var_kl", f"{ACTOR}.ppo_epochs": 1,
    f"{ACTOR}.shuffle": False, f"{ACTOR}.megatron.tensor_model_parallel_size": 1,
    f"{ACTOR}.megatron.pipeline_model_parallel_size": 1, f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size": None,
    f"{ACTOR}.megatron.use_distributed_optimizer": True, f"{ACTOR}.megatron.seed": 42,
    f"{ACTOR}.megatron.expert_model_parallel_size": 1,
    "actor_rollout_ref.model.trust_remote_code": False,
    "actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.top_p": 1.0, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.weight_bucket_mb": 512, "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 1.0, "actor_rollout_ref.rollout.val_kwargs.temperature": 0,
    "actor_rollout_ref.rollout.val_kwargs.n": 1, "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "critic.optim.lr": 1e-5, "critic.ppo_mini_batch_size": 256, "critic.ppo_max_token_len_per_gpu": 32768,
    "critic.ppo_epochs": 1, "critic.cliprange_value": 0.5, "critic.loss_agg_mode": "token-mean",
    "algorithm.gamma": 1.0, "algorithm.lam": 1.0, "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1, "reward.custom_fn.name": "compute_score",
    "trainer.total_epochs": 30, "trainer.total_training_steps": None, "trainer.save_freq": -1,
    "trainer.test_freq": -1, "trainer.val_before_train": True, "trainer.critic_warmup": 0, "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8, "trainer.resume_mode": "auto",
    # not veRL's (null: every checkpoint kept, 15 GB after 7 of a 135M model with its optimizer): mppo keeps the
    # newest 2 by default (issue 14)
    "trainer.max_ckpt_to_keep": 2,
    "algorithm.rollout_correction.rollout_is": None, "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    "algorithm.rollout_correction.rollout_rs": None, "algorithm.rollout_correction.rollout_rs_threshold": None,
    "algorithm.rollout_correction.bypass_mode": False, "algorithm.rollout_correction.loss_type": "ppo_clip",
    "algorithm.rollout_correction.rollout_is_batch_normalize": False,
    "actor_rollout_ref.rollout.ignore_eos": False,
}


def test_resolved_defaults_equal_verl_defaults():
    cfg = load()
    for key, expected in VERL_DEFAULTS.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        assert value == expected, key


# ------------------------------------------------------------------------------------------------------ overrides
def test_overrides_parse_as_yaml_values():
    cfg = load(f"{ACTOR}.optim.lr=3e-6", "critic.optim.lr=0.5", "data.train_batch_size=512",
               f"{ACTOR}.ppo_mini_batch_size=128", f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.shuffle=True",
               "data.shuffle=false", f"{ACTOR}.optim.betas=[0.8, 0.95]", "trainer.logger=[console,wandb]",
               "data.train_files=/d/train.parquet", "data.val_files=['/d/a.parquet', '/d/b.parquet']",
               "trainer.total_training_steps=null", "+trainer.experiment_name=run 7",
               "actor_rollout_ref.rollout.val_kwargs.top_p=0.9", "algorithm.kl_ctrl.horizon=500")
    assert cfg.actor_rollout_ref.actor.optim.lr == 3e-6 and isinstance(cfg.actor_rollout_ref.actor.optim.lr, float)
    assert cfg.critic.optim.lr == 0.5
    assert cfg.data.train_batch_size == 512 and isinstance(cfg.data.train_batch_size, int)
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True and cfg.actor_rollout_ref.actor.shuffle is True
    assert cfg.data.shuffle is False
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.8, 0.95]
    assert cfg.trainer.logger == ["console", "wandb"]
    assert cfg.data.train_files == ["/d/train.parquet"]  # one path for a list key, as veRL accepts
    assert cfg.data.val_files == ["/d/a.parquet", "/d/b.parquet"]
    assert cfg.trainer.total_training_steps is None
    assert cfg.trainer.experiment_name == "run 7"
    assert cfg.actor_rollout_ref.rollout.val_kwargs.top_p == 0.9
    assert cfg.algorithm.kl_ctrl.horizon == 500


def test_later_values_win_and_file_comes_before_overrides(tmp_path):
    path = write(tmp_path, "trainer:\n  seed: 7\n  project_name: p\ndata:\n  max_prompt_length: 100\n")
    cfg = load("trainer.seed=8", "trainer.seed=9", path=path)
    assert (cfg.trainer.seed, cfg.trainer.project_name, cfg.data.max_prompt_length) == (9, "p", 100)
    assert cfg.data.max_response_length == 512  # untouched keys keep the defaults


def test_interpolations_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("MPPO_TEST_RUN_DIR", "/runs/x")
    cfg = load("trainer.project_name=proj", "trainer.experiment_name=exp",
               "actor_rollout_ref.model.path=${oc.env:MPPO_TEST_RUN_DIR}/model",
               "data.train_files=${oc.env:MPPO_TEST_RUN_DIR}/train.parquet")
    assert cfg.trainer.default_local_dir == "checkpoints/proj/exp"
    assert cfg.actor_rollout_ref.model.path == "/runs/x/model"
    assert cfg.data.train_files == ["/runs/x/train.parquet"]


def test_bad_interpolation_names_the_key():
    message = error_of("trainer.seed=${trainer.project_name}")
    assert message.startswith("trainer.seed: cannot resolve '${trainer.project_name}' as an integer")


@pytest.mark.parametrize("text", ["trainer.seed", "=3", "trainer..seed=1", "a.b=[1,"])
def test_malformed_override(text):
    assert "override" in error_of(text)


# ---------------------------------------------------------------------------------------------------- inheritance
def test_nulls_inherit_their_parents():
    cfg = load(f"{ACTOR}.ppo_mini_batch_size=64", f"{ACTOR}.ppo_micro_batch_size_per_gpu=2", f"{ACTOR}.ppo_epochs=3",
               f"{ACTOR}.megatron.tensor_model_parallel_size=2", f"{ACTOR}.megatron.recompute=full",
               f"{ACTOR}.clip_ratio=0.3", f"{ACTOR}.clip_ratio_high=0.28", "trainer.seed=5",
               "actor_rollout_ref.model.path=/m", "critic.megatron.param_offload=true")
    critic, ref, actor = cfg.critic, cfg.actor_rollout_ref.ref, cfg.actor_rollout_ref.actor
    assert (critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu, critic.ppo_epochs) == (64, 2, 3)
    assert critic.megatron.tensor_model_parallel_size == 2 and critic.megatron.recompute == "full"
    assert critic.megatron.param_offload is True  # set explicitly: not overwritten by the actor's
    assert ref.megatron.tensor_model_parallel_size == 2 and ref.megatron.pipeline_model_parallel_size == 1
    assert ref.megatron.param_offload is False
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.28)
    assert (cfg.data.seed, actor.megatron.seed, critic.megatron.seed, ref.megatron.seed) == (5, 5, 5, 5)
    assert cfg.actor_rollout_ref.model.tokenizer_path == "/m" and critic.model.path == "/m"
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 2
    assert ref.log_prob_micro_batch_size_per_gpu == 2


def test_critic_enable_follows_the_estimator_and_vpp_one_means_none():
    assert load().critic.enable is True  # gae
    assert load("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4").critic.enable is False
    cfg = load(f"{ACTOR}.megatron.pipeline_model_parallel_size=2",
               f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size=2",
               "critic.megatron.virtual_pipeline_model_parallel_size=1")
    assert cfg.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size == 2
    assert cfg.critic.megatron.virtual_pipeline_model_parallel_size is None


# ------------------------------------------------------------------------------------------------- unknown / types
def test_unknown_key_in_override_suggests_the_closest():
    message = error_of(f"{ACTOR}.optim.lrr=1e-6")
    assert message == (f"unknown key '{ACTOR}.optim.lrr' (override '{ACTOR}.optim.lrr=1e-6'); "
                       f"did you mean '{ACTOR}.optim.lr'?")
    assert "did you mean 'trainer.seed'?" in error_of("traner.seed=1")
    assert f"'{ACTOR}.optim.lr' or 'critic.optim.lr'" in error_of("trainer.lr=1")  # right name, wrong section
    assert "lists every key" in error_of("trainer.frobnicate=1")


def test_unknown_key_in_file_names_file_and_suggestion(tmp_path):
    path = write(tmp_path, "algorithm:\n  kl_ctrl:\n    kl_coeff: 0.01\n")
    message = error_of(path=path)
    assert f"unknown key 'algorithm.kl_ctrl.kl_coeff' (in {path})" in message
    assert "did you mean 'algorithm.kl_ctrl.kl_coef'?" in message
    assert "unknown key 'defaults'" in error_of(path=write(tmp_path, "defaults: [ppo_trainer]\n", "d.yaml"))


def test_a_section_is_not_a_value(tmp_path):
    assert "'critic' is a section, not a value" in error_of("critic=3")
    assert load(path=write(tmp_path, "critic:\ntrainer: {}\n")) == load()  # empty sections change nothing


@pytest.mark.parametrize("override, expected", [
    ("trainer.seed=abc", "trainer.seed must be an integer, got 'abc'"),
    ("trainer.seed=1.5", "trainer.seed must be an integer, got 1.5"),
    (f"{ACTOR}.optim.lr=fast", f"{ACTOR}.optim.lr must be a number, got 'fast'"),
    (f"{ACTOR}.use_kl_loss=5", f"{ACTOR}.use_kl_loss must be true or false, got 5"),
    (f"{ACTOR}.use_kl_loss=null", f"{ACTOR}.use_kl_loss must be true or false, got null"),
    (f"{ACTOR}.optim.betas=0.9", f"{ACTOR}.optim.betas must be a list of numbers, got 0.9"),
    (f"{ACTOR}.optim.betas=[a,b]", f"{ACTOR}.optim.betas must be a list of numbers"),
    ("data.train_batch_size=null", "data.train_batch_size must be an integer, got null"),
    ("data.val_batch_size=x", "data.val_batch_size must be an integer or null, got 'x'"),
    ("trainer.project_name=[a]", "trainer.project_name must be a string, got ['a']"),
])
def test_wrong_type(override, expected):
    message = error_of(override)
    assert message.startswith(expected) and f"(override '{override}')" in message


def test_wrong_type_in_file(tmp_path):
    path = write(tmp_path, "trainer:\n  nnodes: two\n")
    assert error_of(path=path) == f"trainer.nnodes must be an integer, got 'two' (in {path})"


def test_yaml_file_problems(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found: .*nope.yaml"):
        load(path=tmp_path / "nope.yaml")
    dup = write(tmp_path, "trainer:\n  seed: 1\n  seed: 2\n", "dup.yaml")
    assert error_of(path=dup) == f"{dup}: line 3 is not valid YAML: key 'seed' appears twice"
    assert "is not valid YAML" in error_of(path=write(tmp_path, "trainer: [1,\n", "bad.yaml"))
    assert "top level must be a mapping" in error_of(path=write(tmp_path, "- 1\n", "list.yaml"))


# -------------------------------------------------------------------------------------------------------- choices
@pytest.mark.parametrize("override, expected", [
    ("algorithm.adv_estimator=grpoo", "algorithm.adv_estimator = 'grpoo' is not a known advantage estimator "
                                      "(did you mean 'grpo'?); choose one of: gae,"),
    (f"{ACTOR}.policy_loss.loss_mode=vanila", "is not a known policy loss mode (did you mean 'vanilla'?)"),
    (f"{ACTOR}.loss_agg_mode=token_mean", "is not a known loss aggregation mode (did you mean 'token-mean'?)"),
    ("critic.loss_agg_mode=seq-mean", "critic.loss_agg_mode = 'seq-mean' is not a known loss aggregation mode"),
    (f"{ACTOR}.kl_loss_type=low_var", f"{ACTOR}.kl_loss_type = 'low_var' is not a known KL estimator"),
    ("algorithm.kl_penalty=k4", "algorithm.kl_penalty = 'k4' is not a known KL estimator"),
    ("actor_rollout_ref.model.transformer_impl=tee", "choose one of: auto, local, sdpa, te"),
    ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.name = 'vllm' is not a known value"),
    ("trainer.logger=[console,mlflow]", "trainer.logger = 'mlflow' is not a known value"),
    (f"{ACTOR}.megatron.recompute=some", "choose one of: full, none, selective"),
])
def test_bad_choice(override, expected):
    assert expected in error_of(override)


def test_choices_come_from_the_core_algos_registries():
    from mppo.core_algos import (ADV_ESTIMATOR_REGISTRY, AGG_LOSS_MODES, ESTIMATORS_NEEDING_GROUPS,
                                 KL_PENALTY_TYPES, POLICY_LOSS_REGISTRY)

    for name in ADV_ESTIMATOR_REGISTRY:
        n = 4 if name in ESTIMATORS_NEEDING_GROUPS else 1
        load(f"algorithm.adv_estimator={name}", f"actor_rollout_ref.rollout.n={n}", "critic.enable=null")
    for mode in POLICY_LOSS_REGISTRY:
        load(f"{ACTOR}.policy_loss.loss_mode={mode}", f"{ACTOR}.policy_loss.dro_beta=0.1")
    for mode in AGG_LOSS_MODES:
        load(f"{ACTOR}.loss_agg_mode={mode}")
    for kl in KL_PENALTY_TYPES:
        load(f"{ACTOR}.kl_loss_type={kl}", f"algorithm.kl_penalty={kl}")


# --------------------------------------------------------------------------------------------------------- ranges
@pytest.mark.parametrize("override, expected", [
    (f"{ACTOR}.clip_ratio=0", f"{ACTOR}.clip_ratio = 0.0: must be > 0"),
    (f"{ACTOR}.clip_ratio_low=-0.1", f"{ACTOR}.clip_ratio_low = -0.1: must be > 0"),
    (f"{ACTOR}.clip_ratio_high=0", f"{ACTOR}.clip_ratio_high = 0.0: must be > 0"),
    (f"{ACTOR}.clip_ratio_c=1.0", f"{ACTOR}.clip_ratio_c = 1.0: must be > 1"),
    ("critic.cliprange_value=0", "critic.cliprange_value = 0.0: must be > 0"),
    ("actor_rollout_ref.rollout.temperature=0", "actor_rollout_ref.rollout.temperature = 0.0: must be > 0"),
    ("actor_rollout_ref.rollout.top_p=1.5", "must be in (0, 1]"),
    ("actor_rollout_ref.rollout.n=0", "actor_rollout_ref.rollout.n = 0: must be >= 1"),
    ("algorithm.gamma=1.1", "algorithm.gamma = 1.1: must be in [0, 1]"),
    ("trainer.save_freq=0", "trainer.save_freq = 0: must be -1 (off) or >= 1"),
    ("critic.optim.lr=-1e-5", "critic.optim.lr = -1e-05: must be > 0"),
    (f"{ACTOR}.optim.lr=0", f"{ACTOR}.optim.lr = 0.0: must be > 0"),
    (f"{ACTOR}.optim.betas=[0.9]", f"{ACTOR}.optim.betas = [0.9]: Adam needs two betas in [0, 1)"),
    (f"{ACTOR}.megatron.tensor_model_parallel_size=null", f"{ACTOR}.megatron.tensor_model_parallel_size is null"),
])
def test_out_of_range(override, expected):
    assert expected in error_of(override)


# -------------------------------------------------------------------------------------------------- layout, sizes
def test_world_size_must_match_the_launch():
    load(world_size=8)
    message = error_of(world_size=4)
    assert message.startswith("the launch has 4 ranks (WORLD_SIZE) but trainer.nnodes x trainer.n_gpus_per_node")
    assert "trainer.n_gpus_per_node=4" in message


def test_sequence_parallel_is_on_iff_tp_and_needs_tp():
    from mppo.config.decisions import uses_sequence_parallel

    cfg = load(f"{ACTOR}.megatron.tensor_model_parallel_size=2")
    assert cfg.actor_rollout_ref.actor.megatron.sequence_parallel is None  # null: on iff TP > 1 (veRL's default)
    assert uses_sequence_parallel(cfg.actor_rollout_ref.actor.megatron)
    assert uses_sequence_parallel(cfg.critic.megatron)
    assert not uses_sequence_parallel(load().actor_rollout_ref.actor.megatron)  # TP 1
    off = load(f"{ACTOR}.megatron.tensor_model_parallel_size=2", f"{ACTOR}.megatron.sequence_parallel=false")
    assert not uses_sequence_parallel(off.actor_rollout_ref.actor.megatron)
    assert not uses_sequence_parallel(off.critic.megatron)  # inherits the actor's false
    message = error_of(f"{ACTOR}.megatron.sequence_parallel=true")
    assert message.startswith(f"{ACTOR}.megatron.sequence_parallel = true: sequence parallelism splits the sequence "
                              "over the TP ranks, and TP is 1")


def test_overlap_is_on_iff_nccl_and_what_megatron_needs():
    from mppo.config.decisions import uses_overlap_grad_reduce, uses_overlap_param_gather

    cfg = load()
    actor, critic = cfg.actor_rollout_ref.actor.megatron, cfg.critic.megatron
    assert actor.overlap_grad_reduce is None and actor.overlap_param_gather is None  # null: by the backend
    for m in (actor, critic):  # the critic inherits the actor's nulls
        assert uses_overlap_grad_reduce(m, "nccl") and uses_overlap_param_gather(m, "nccl")
        assert not uses_overlap_grad_reduce(m, "gloo") and not uses_overlap_param_gather(m, "gloo")
    plain = load(f"{ACTOR}.megatron.use_distributed_optimizer=false").actor_rollout_ref.actor.megatron
    assert uses_overlap_grad_reduce(plain, "nccl") and not uses_overlap_param_gather(plain, "nccl")
    no_reduce = load(f"{ACTOR}.megatron.overlap_grad_reduce=false").critic.megatron
    assert not uses_overlap_param_gather(no_reduce, "nccl")  # megatron overlaps the gather only with it
    gather = load(f"{ACTOR}.megatron.overlap_param_gather=true").critic.megatron
    assert uses_overlap_grad_reduce(gather, "gloo") and uses_overlap_param_gather(gather, "gloo")
    message = error_of(f"{ACTOR}.megatron.overlap_param_gather=true",
                       f"{ACTOR}.megatron.use_distributed_optimizer=false")
    assert message.startswith(f"{ACTOR}.megatron.overlap_param_gather = true: it overlaps the distributed "
                              "optimizer's parameter all-gather, and use_distributed_optimizer is false; set ")
    message = error_of("critic.megatron.overlap_param_gather=true", "critic.megatron.overlap_grad_reduce=false")
    assert message.startswith("critic.megatron.overlap_param_gather = true: megatron-core overlaps the parameter "
                              "all-gather only with overlap_grad_reduce, which is false; set ")


def test_expert_tensor_parallel_is_tp_by_default_and_must_fit():
    from mppo.config.decisions import expert_tensor_parallel_size

    cfg = load(f"{ACTOR}.megatron.tensor_model_parallel_size=2")
    assert expert_tensor_parallel_size(cfg.actor_rollout_ref.actor.megatron) == 2  # null: TP, megatron's default
    etp1 = load(f"{ACTOR}.megatron.tensor_model_parallel_size=2", f"{ACTOR}.megatron.expert_tensor_parallel_size=1",
                f"{ACTOR}.megatron.expert_model_parallel_size=8")  # EP over TP x DP: ETP x EP = 8 ranks
    assert expert_tensor_parallel_size(etp1.critic.megatron) == 1
    message = error_of(f"{ACTOR}.megatron.tensor_model_parallel_size=2",
                       f"{ACTOR}.megatron.expert_tensor_parallel_size=1", f"{ACTOR}.megatron.expert_model_parallel_size=3")
    assert message.startswith(f"{ACTOR}.megatron.expert_tensor_parallel_size = 1: ETP x EP = 1 x 3 = 3 does not "
                              "divide the 8 ranks of a pipeline stage")
    message = error_of(f"{ACTOR}.megatron.expert_tensor_parallel_size=0")
    assert message.startswith(f"{ACTOR}.megatron.expert_tensor_parallel_size = 0: must be >= 1")
    load("critic.megatron.expert_tensor_parallel_size=2", f"{ACTOR}.megatron.tensor_model_parallel_size=2")  # = TP
    message = error_of("critic.megatron.expert_tensor_parallel_size=1", f"{ACTOR}.megatron.tensor_model_parallel_size=2",
                       f"{ACTOR}.megatron.expert_model_parallel_size=2")
    assert message.startswith("critic.megatron.expert_tensor_parallel_size=1 differs from the actor's 2")


@pytest.mark.parametrize("role", [ACTOR, "critic", "actor_rollout_ref.ref"])
def test_tp_times_pp_must_divide_the_world(role):
    kl = [f"{ACTOR}.use_kl_loss=true"] if role.endswith("ref") else []  # the ref is only built when KL is used
    message = error_of(f"{role}.megatron.tensor_model_parallel_size=3", *kl)
    assert message.startswith(f"{role}.megatron: TP x PP = 3 x 1 = 3 does not divide the world size 8")
    message = error_of(f"{role}.megatron.pipeline_model_parallel_size=4",
                       f"{role}.megatron.tensor_model_parallel_size=4", "trainer.nnodes=2",
                       "trainer.n_gpus_per_node=4", *kl)
    assert message.startswith(f"{role}.megatron: TP x PP = 4 x 4 = 16 does not divide the world size 8")


@pytest.mark.parametrize("role", [ACTOR, "critic", "actor_rollout_ref.ref"])
def test_context_parallel_layouts_that_cannot_run_stop_in_one_line(role):
    kl = [f"{ACTOR}.use_kl_loss=true"] if role.endswith("ref") else []
    message = error_of(f"{role}.megatron.context_parallel_size=3", *kl)
    assert message.startswith(f"{role}.megatron.context_parallel_size = 3: TP x PP x CP = 1 x 1 x 3 = 3 does not "
                              "divide the world size 8")
    message = error_of(f"{role}.megatron.context_parallel_size=2", f"{role}.megatron.tensor_model_parallel_size=2",
                       f"{role}.megatron.pipeline_model_parallel_size=4", *kl)
    assert message.startswith(f"{role}.megatron.context_parallel_size = 2: TP x PP x CP = 2 x 4 x 2 = 16 does not")
    message = error_of(f"{role}.megatron.context_parallel_size=0", *kl)
    assert message.startswith(f"{role}.megatron.context_parallel_size = 0: must be >= 1")
    message = error_of(f"{role}.megatron.context_parallel_size=2", f"{role}.megatron.expert_model_parallel_size=2",
                       *kl)
    assert message.startswith(f"{role}.megatron.context_parallel_size = 2: context parallelism is not supported "
                              "with expert parallelism")
    message = error_of(f"{role}.megatron.context_parallel_size=2", "actor_rollout_ref.model.transformer_impl=local",
                       *kl)
    assert message.startswith(f"{role}.megatron.context_parallel_size = 2: megatron's local attention")


def test_context_parallel_takes_ranks_from_data_parallelism_and_is_inherited():
    cfg = load(f"{ACTOR}.megatron.context_parallel_size=2", f"{ACTOR}.megatron.tensor_model_parallel_size=2")
    assert cfg.critic.megatron.context_parallel_size == 2  # null: the actor's
    assert cfg.actor_rollout_ref.ref.megatron.context_parallel_size == 2
    assert load().actor_rollout_ref.actor.megatron.context_parallel_size == 1
    # DP = 8 / (TP 2 x CP 2) = 2: a mini-batch of 3 prompts x n=1 does not split over 2 DP ranks
    message = error_of(f"{ACTOR}.megatron.context_parallel_size=2", f"{ACTOR}.megatron.tensor_model_parallel_size=2",
                       "data.train_batch_size=3", f"{ACTOR}.ppo_mini_batch_size=3")
    assert message.endswith("does not split over DP = 2 ranks; make ppo_mini_batch_size x rollout.n a multiple of 2")


def test_unused_ref_and_critic_layouts_must_still_be_the_actors():
    """Each role's own layout is checked only for the models the run builds, but megatron has one set of process
    groups: a layout other than the actor's is refused for a critic or reference that is not built too."""
    message = error_of("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2")  # no KL: no reference model
    assert message.startswith("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2 differs from the actor's 1")
    message = error_of("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                       "critic.megatron.tensor_model_parallel_size=3")  # no critic
    assert message.startswith("critic.megatron.tensor_model_parallel_size=3 differs from the actor's 1")


def test_virtual_pipeline_needs_pipeline():
    message = error_of(f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size=2")
    assert message.startswith(f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size = 2: interleaving needs")
    load(f"{ACTOR}.megatron.virtual_pipeline_model_parallel_size=1")  # 1 = no interleaving


def test_expert_parallel_must_divide_data_parallel_and_is_inherited():
    cfg = load(f"{ACTOR}.megatron.expert_model_parallel_size=4", f"{ACTOR}.megatron.tensor_model_parallel_size=2")
    assert cfg.critic.megatron.expert_model_parallel_size == 4  # null: the actor's
    assert cfg.actor_rollout_ref.ref.megatron.expert_model_parallel_size == 4
    message = error_of(f"{ACTOR}.megatron.expert_model_parallel_size=4", f"{ACTOR}.megatron.tensor_model_parallel_size=4")
    assert message == (f"{ACTOR}.megatron.expert_model_parallel_size = 4: the experts are split over data-parallel "
                       "ranks, and DP = world 8 / (TP x PP = 4) = 2 is not a multiple of it; use a divisor of 2: 1, 2")
    assert "must be >= 1" in error_of(f"{ACTOR}.megatron.expert_model_parallel_size=0")


def _moe_dir(tmp_path: Path, name: str, experts: int | None) -> Path:
    import json

    model = tmp_path / name
    model.mkdir()
    config = {"model_type": "qwen3_moe" if experts else "qwen3", "vocab_size": 100}
    if experts:
        config["num_experts"] = experts
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_expert_parallel_must_divide_the_models_experts(tmp_path):
    six, dense = _moe_dir(tmp_path, "six", 6), _moe_dir(tmp_path, "dense", None)
    load(f"actor_rollout_ref.model.path={six}", f"{ACTOR}.megatron.expert_model_parallel_size=2")
    message = error_of(f"actor_rollout_ref.model.path={six}", f"{ACTOR}.megatron.expert_model_parallel_size=4")
    assert message == (f"{ACTOR}.megatron.expert_model_parallel_size = 4: does not divide the 6 experts of the model "
                       f"at {str(six)!r}; use a divisor of 6 that divides DP: 1, 2, 3, 6")
    message = error_of(f"actor_rollout_ref.model.path={dense}", f"{ACTOR}.megatron.expert_model_parallel_size=2")
    assert message.startswith(f"{ACTOR}.megatron.expert_model_parallel_size = 2: the model at {str(dense)!r} is "
                              "dense (qwen3, no routed experts); set it to 1")
    load(f"actor_rollout_ref.model.path={dense}")


def test_router_replay_needs_a_moe_model_and_engine_routes(tmp_path):
    six, dense = _moe_dir(tmp_path, "six", 6), _moe_dir(tmp_path, "dense", None)
    r3 = [f"actor_rollout_ref.model.path={six}", f"{ACTOR}.router_replay.mode=R3", "actor_rollout_ref.rollout.name=cpu",
          "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    load(*r3)
    load(*r3, "actor_rollout_ref.rollout.name=sglang")  # SGLang returns its routes too (docs/MOE.md)
    key = f"{ACTOR}.router_replay.mode = 'R3'"
    assert error_of(*r3[1:], f"actor_rollout_ref.model.path={dense}") == (
        f"{key}: the model is dense (qwen3): there are no routes to replay; set {ACTOR}.router_replay.mode=disabled")
    for override, why in (("actor_rollout_ref.rollout.multi_turn.enable=true", "rollout.multi_turn.enable=true"),
                          ("algorithm.filter_groups.enable=true actor_rollout_ref.rollout.n=2",
                           "algorithm.filter_groups.enable=true"),
                          (f"{ACTOR}.megatron.recompute=full", "megatron.recompute")):
        message = error_of(*r3, *override.split())
        assert message.startswith(f"{key}: not supported with {why}"), message
        assert message.endswith(f"set {ACTOR}.router_replay.mode=disabled")
    assert "choose one of: R3, disabled" in error_of(*r3[:1], f"{ACTOR}.router_replay.mode=R2")


def test_moe_loss_coefficients_are_inherited_and_non_negative():
    cfg = load(f"{ACTOR}.megatron.override_transformer_config.moe_aux_loss_coeff=0.01")
    assert cfg.critic.megatron.override_transformer_config.moe_aux_loss_coeff == 0.01
    assert cfg.actor_rollout_ref.ref.megatron.override_transformer_config.moe_z_loss_coeff == 0.0
    message = error_of(f"{ACTOR}.megatron.override_transformer_config.moe_z_loss_coeff=-1")
    assert message == f"{ACTOR}.megatron.override_transformer_config.moe_z_loss_coeff = -1.0: must be >= 0"


def test_rollout_engine_must_fit_in_a_node():
    message = error_of("actor_rollout_ref.rollout.tensor_model_parallel_size=3")
    assert "an engine must live within one node of 8 ranks" in message


def _splits_evenly(train_batch: int, n: int, mini: int, micro: int, dp: int) -> bool:
    """Reference: deal a step's samples into mini-batches, those over DP ranks, those into micro-batches."""
    samples = list(range(train_batch * n))
    minis = [samples[i:i + mini * n] for i in range(0, len(samples), mini * n)]
    if mini > train_batch or any(len(m) != mini * n for m in minis):
        return False
    for m in minis:
        shards = [m[r::dp] for r in range(dp)]
        if len({len(s) for s in shards}) != 1:
            return False
        if any(len(s[i:i + micro]) != micro for s in shards for i in range(0, len(s), micro)):
            return False
    return True


def test_batch_arithmetic_matches_an_explicit_split():
    cases = itertools.product([6, 8, 12], [1, 2, 3], [2, 3, 4, 8, 16], [1, 2, 3, 4], [(1, 1), (2, 1), (1, 2)])
    outcomes = []
    for train_batch, n, mini, micro, (tp, dp_div) in cases:
        dp = 4 // tp // dp_div
        overrides = [f"data.train_batch_size={train_batch}", f"actor_rollout_ref.rollout.n={n}",
                     f"{ACTOR}.ppo_mini_batch_size={mini}", f"{ACTOR}.ppo_micro_batch_size_per_gpu={micro}",
                     f"{ACTOR}.megatron.tensor_model_parallel_size={tp}",
                     f"{ACTOR}.megatron.pipeline_model_parallel_size={dp_div}", "trainer.n_gpus_per_node=4",
                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1"]
        expected = _splits_evenly(train_batch, n, mini, micro, dp)
        try:
            load(*overrides)
            ok = True
        except ConfigError as e:
            ok = False
            assert "mini" in str(e) or "micro" in str(e), str(e)
        assert ok == expected, (train_batch, n, mini, micro, tp, dp, ok)
        outcomes.append(ok)
    assert 50 < sum(outcomes) < len(outcomes) - 50  # both verdicts well represented


def test_batch_errors_name_key_and_fix():
    assert error_of(f"{ACTOR}.ppo_mini_batch_size=2048") == (
        f"{ACTOR}.ppo_mini_batch_size = 2048: larger than data.train_batch_size = 1024; use at most 1024")
    assert error_of("data.train_batch_size=12", f"{ACTOR}.ppo_mini_batch_size=8").endswith(
        "use a divisor of 12: 1, 2, 3, 4, 6, 12")
    assert "does not split over DP = 8 ranks" in error_of("data.train_batch_size=12", f"{ACTOR}.ppo_mini_batch_size=6")
    message = error_of(f"{ACTOR}.ppo_micro_batch_size_per_gpu=5")
    assert message == (f"{ACTOR}.ppo_micro_batch_size_per_gpu = 5: does not divide the 32 samples per DP rank of a "
                       "mini-batch (256 prompts x n 1 / DP 8); use a divisor of 32: 1, 2, 4, 8, 16, 32")
    assert error_of("critic.ppo_micro_batch_size_per_gpu=3").startswith("critic.ppo_micro_batch_size_per_gpu = 3")
    assert error_of("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5").startswith(
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = 5: does not divide the 128 samples")
    message = error_of("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3", f"{ACTOR}.use_kl_loss=true")
    assert message.startswith("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu = 3")


def test_dynamic_batch_size_needs_room_for_one_sequence():
    load(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_micro_batch_size_per_gpu=5")  # micro unused then
    message = error_of(f"{ACTOR}.use_dynamic_bsz=true", f"{ACTOR}.ppo_max_token_len_per_gpu=1000")
    assert message.startswith(f"{ACTOR}.ppo_max_token_len_per_gpu = 1000: a single sequence can have 1024 tokens")


# ------------------------------------------------------------------------------------------------------ algorithm
def test_gae_without_critic():
    assert error_of("critic.enable=false") == (
        "critic.enable = false: algorithm.adv_estimator = 'gae' needs a critic's values; set critic.enable=true "
        "(or null), or use an estimator without values (grpo)")


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_grouped_estimator_needs_several_samples(estimator):
    message = error_of(f"algorithm.adv_estimator={estimator}")
    assert message.startswith("actor_rollout_ref.rollout.n = 1: algorithm.adv_estimator")
    assert "set actor_rollout_ref.rollout.n >= 2" in message


def test_estimator_inputs_the_trainer_cannot_produce_are_rejected():
    """Each estimator's declared needs are checked: OTB's sum_pi_squared needs the actor to compute it and an actor
    log-prob pass (not bypass mode); null turns it on for exactly the estimators that declare it."""
    otb = ("algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.rollout.n=2")
    assert load(*otb).actor_rollout_ref.actor.calculate_sum_pi_squared is True
    assert load("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"
                ).actor_rollout_ref.actor.calculate_sum_pi_squared is False
    assert error_of(*otb, f"{ACTOR}.calculate_sum_pi_squared=false") == (
        f"{ACTOR}.calculate_sum_pi_squared = false: algorithm.adv_estimator = 'optimal_token_baseline' needs "
        "sum_pi_squared from the actor's log-prob pass; set it to true (or null)")
    message = error_of(*otb, "algorithm.rollout_correction.bypass_mode=true")
    assert message.startswith("algorithm.rollout_correction.bypass_mode = true: ") and "bypass_mode=false" in message
    load("algorithm.adv_estimator=remax", "critic.enable=null")  # its greedy baselines are generated by the trainer


def test_dynamic_sampling_settings():
    grpo = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=8",
            f"{ACTOR}.ppo_mini_batch_size=8", f"{ACTOR}.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1")
    load(*grpo, "algorithm.filter_groups.enable=true", "data.gen_batch_size=24")
    assert error_of(*grpo, "data.gen_batch_size=24").startswith(
        "data.gen_batch_size = 24: differs from data.train_batch_size = 8 without dynamic sampling")
    assert error_of(*grpo, "algorithm.filter_groups.enable=true", "data.gen_batch_size=4").startswith(
        "data.gen_batch_size = 4: smaller than data.train_batch_size = 8")
    assert "does not split over the 8 data-parallel ranks" in error_of(
        *grpo, "algorithm.filter_groups.enable=true", "data.gen_batch_size=12")
    assert error_of("algorithm.adv_estimator=remax", "critic.enable=null", "algorithm.filter_groups.enable=true"
                    ).startswith("actor_rollout_ref.rollout.n = 1: algorithm.filter_groups drops groups")
    fg = ("algorithm.filter_groups.enable=true", "data.gen_batch_size=24")
    assert error_of(*grpo, *fg, "algorithm.filter_groups.metric=accuracy") == (
        "algorithm.filter_groups.metric = 'accuracy' is not a known value; choose one of: "
        "acc, reward, score, seq_final_reward, seq_reward")
    for metric in ("reward", "acc", "seq_reward", "seq_final_reward"):
        assert load(*grpo, *fg, f"algorithm.filter_groups.metric={metric}").algorithm.filter_groups.metric == metric
    assert error_of(*grpo, *fg, "algorithm.filter_groups.metric=score") == (
        "algorithm.filter_groups.metric = 'score': the built-in reward functions return a number, which counts as "
        "'acc' (no 'score' key of a dict return); use metric=acc or metric=reward, or a reward.custom_fn that "
        "returns {'score': ...}")
    load(*grpo, *fg, "algorithm.filter_groups.metric=score", "reward.custom_fn.path=mine.py")  # known when it runs
    assert error_of(*grpo, *fg, "algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"
                    ).startswith("algorithm.filter_groups.metric = 'seq_final_reward': the reward after the in-reward "
                                 "KL penalty needs the reference log-probs")
    load(*grpo, "algorithm.filter_groups.metric=score")  # without dynamic sampling the metric is not used


def test_kl_in_reward_and_kl_loss_together():
    message = error_of("algorithm.use_kl_in_reward=true", f"{ACTOR}.use_kl_loss=true")
    assert "both true" in message and "set one of them to false" in message


def test_other_algorithm_errors():
    assert "there is no critic to warm up" in error_of("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                                                       "trainer.critic_warmup=2")
    assert "loss_mode 'dro' needs its penalty weight" in error_of(f"{ACTOR}.policy_loss.loss_mode=dro")
    assert "Transformer Engine needs CUDA" in error_of("actor_rollout_ref.model.transformer_impl=te",
                                                       "trainer.device=cpu")


RC = "algorithm.rollout_correction"


def test_rollout_correction_settings_parse():
    cfg = load(f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_5.0", f"{RC}.rollout_rs=token_k1,seq_mean_k3",
               f"{RC}.rollout_rs_threshold=0.5_2.0,0.01", f"{RC}.rollout_is_batch_normalize=true")
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_is_threshold, rc.rollout_rs) == ("token", "0.5_5.0", "token_k1,seq_mean_k3")
    assert rc.rollout_rs_threshold == "0.5_2.0,0.01" and rc.rollout_is_batch_normalize is True
    # a number is a number (an integer too), and YAML 1.1's digit separators do not eat the '_' of bounds
    assert load(f"{RC}.rollout_is_threshold=3").algorithm.rollout_correction.rollout_is_threshold == 3.0
    assert load(f"{RC}.rollout_rs=seq_sum_k2", f"{RC}.rollout_rs_threshold=2").algorithm.rollout_correction \
        .rollout_rs_threshold == 2.0


def test_rollout_correction_in_a_file_keeps_its_bounds(tmp_path):
    path = write(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is: sequence\n"
                           "    rollout_is_threshold: 5_10\n")
    assert load(path=path).algorithm.rollout_correction.rollout_is_threshold == "5_10"  # IcePop [5, 10], not 510


@pytest.mark.parametrize("overrides,expected", [
    ([f"{RC}.rollout_is=tokens"], f"{RC}.rollout_is = 'tokens' is not a known IS level (or null: off) (did you mean "
                                  "'token'?); choose one of: sequence, token"),
    ([f"{RC}.loss_type=pg"], f"{RC}.loss_type = 'pg' is not a known bypass-mode loss type; choose one of: ppo_clip, "
                             "reinforce"),
    ([f"{RC}.rollout_rs=token_k1,seq_k2", f"{RC}.rollout_rs_threshold=2"],
     f"{RC}.rollout_rs = 'seq_k2' is not a known rejection criterion (did you mean 'seq_sum_k2'?); choose one of: "
     "seq_max_k2, seq_max_k3, seq_mean_k1, seq_mean_k2, seq_mean_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, token_k1, "
     "token_k2, token_k3"),
    ([f"{RC}.rollout_is_threshold=abc"], f"{RC}.rollout_is_threshold = 'abc': "),
    ([f"{RC}.rollout_is_threshold=5_0.5"], "lower bound must be <= upper bound"),
    ([f"{RC}.rollout_is_threshold=-2"], "must be positive"),
    ([f"{RC}.rollout_rs=token_k1"], f"{RC}.rollout_rs_threshold = null: rollout_rs = 'token_k1' needs its threshold"),
    ([f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold=0.5_2"], "must provide a single upper bound"),
    ([f"{RC}.rollout_rs=token_k1,token_k2", f"{RC}.rollout_rs_threshold=1,2,3"], "exactly 2 thresholds"),
    ([f"{RC}.bypass_mode=true", f"{ACTOR}.policy_loss.loss_mode=gspo"], "loss_mode = 'gspo' would be ignored"),
    ([f"{RC}.bypass_mode=true", f"{RC}.rollout_is_batch_normalize=true"], "would depend on the micro-batch split"),
])
def test_rollout_correction_errors_name_key_and_choices(overrides, expected):
    assert expected in error_of(*overrides)


def _model_dir(tmp_path: Path, name: str, max_positions: int | None) -> Path:
    import json

    model = tmp_path / name
    model.mkdir()
    config = {"model_type": "qwen2", "vocab_size": 100}
    if max_positions is not None:
        config["max_position_embeddings"] = max_positions
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_sequence_longer_than_the_models_positions(tmp_path):
    """prompt + response beyond max_position_embeddings: one line naming both keys and the model's limit."""
    actor = _model_dir(tmp_path, "actor", 8192)
    message = error_of(f"actor_rollout_ref.model.path={actor}", "data.max_prompt_length=1024",
                       "data.max_response_length=8192")
    assert message == (f"data.max_prompt_length + data.max_response_length = 1024 + 8192 = 9216 tokens, more than "
                       f"the model's max_position_embeddings = 8192 (actor_rollout_ref.model.path={str(actor)!r}); "
                       "lower data.max_response_length to at most 7168, or use a model with more positions")
    load(f"actor_rollout_ref.model.path={actor}", "data.max_prompt_length=1024", "data.max_response_length=7168")
    # a prompt that alone fills the positions
    assert "lower data.max_prompt_length and data.max_response_length" in error_of(
        f"actor_rollout_ref.model.path={actor}", "data.max_prompt_length=8192", "data.max_response_length=1")
    # the critic's own model is checked too; without a critic it is not read
    critic = _model_dir(tmp_path, "critic", 1024)
    lengths = ("data.max_prompt_length=512", "data.max_response_length=1024")
    assert "(critic.model.path=" in error_of(f"actor_rollout_ref.model.path={actor}", f"critic.model.path={critic}",
                                             "algorithm.adv_estimator=gae", *lengths)
    load(f"actor_rollout_ref.model.path={actor}", f"critic.model.path={critic}", "algorithm.adv_estimator=grpo",
         "actor_rollout_ref.rollout.n=2", *lengths)
    # no config.json or no max_position_embeddings in it: nothing to check here (the model loader reports it)
    load(f"actor_rollout_ref.model.path={tmp_path / 'missing'}", "data.max_response_length=100000")
    load(f"actor_rollout_ref.model.path={_model_dir(tmp_path, 'nolimit', None)}", "data.max_response_length=100000")


def test_suspicious_settings_warn():
    with pytest.warns(ConfigWarning, match="the critic would train for nothing"):
        load("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "critic.enable=true")
    with pytest.warns(ConfigWarning, match="identical greedy responses"):
        load("actor_rollout_ref.rollout.val_kwargs.n=4")
    with pytest.warns(ConfigWarning, match="only applies with algorithm.rollout_correction.bypass_mode=true"):
        load("algorithm.rollout_correction.loss_type=reinforce")
    for key, value in (("seed", 7), ("use_distributed_optimizer", "false"), ("optimizer_offload", "true")):
        with pytest.warns(ConfigWarning, match=f"actor_rollout_ref.ref.megatron.{key} = .* does nothing: the "
                                               "reference policy never trains"):
            load(f"actor_rollout_ref.ref.megatron.{key}={value}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load()  # the defaults are quiet
        load("actor_rollout_ref.actor.megatron.seed=7")  # the ref's null follows the actor's


def test_validate_accepts_a_hand_built_config():
    cfg = MppoConfig()
    validate(cfg)
    cfg.critic.enable = False
    with pytest.raises(ConfigError, match="needs a critic"):
        validate(cfg)


# --------------------------------------------------------------------------------------------- round trip, hashing
def test_to_yaml_round_trips(tmp_path):
    cfg = load("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", f"{ACTOR}.optim.lr=2e-6",
               "data.train_files=[a.parquet,b.parquet]", "trainer.experiment_name=x")
    path = write(tmp_path, to_yaml(cfg))
    assert load(path=path) == cfg
    assert list(yaml.safe_load(to_yaml(cfg))) == ["data", "actor_rollout_ref", "critic", "algorithm", "reward",
                                                   "trainer", "async_training"]


def test_config_hash_is_stable_and_sensitive():
    a = load("trainer.seed=3", f"{ACTOR}.optim.lr=2e-6")
    b = load(f"{ACTOR}.optim.lr=2e-6", "trainer.seed=3")
    assert config_hash(a) == config_hash(b) and re.fullmatch(r"[0-9a-f]{64}", config_hash(a))
    for key in ("trainer.seed=4", f"{ACTOR}.optim.lr=2.0001e-6", "data.train_files=x.parquet"):
        assert config_hash(load("trainer.seed=3", f"{ACTOR}.optim.lr=2e-6", key)) != config_hash(a), key


def test_every_schema_key_is_settable_by_override():
    cfg = load()
    for key in schema_leaves():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        assert load(f"{key}={text}") == cfg, key


# ------------------------------------------------------------------------------------------------------------ LoRA
@pytest.mark.parametrize("overrides, expected", [
    (["actor_rollout_ref.model.lora.rank=-1"], "actor_rollout_ref.model.lora.rank = -1: must be >= 0"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.target_modules=[q_proj,qkv]"],
     "actor_rollout_ref.model.lora.target_modules = 'qkv' is not a module LoRA can adapt"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.exclude_modules=[all-linear]"],
     "leaves nothing to adapt"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.merge=false",
      "actor_rollout_ref.rollout.name=cpu"],
     "actor_rollout_ref.model.lora.merge = false pushes only the adapters, to SGLang's LoRA support; the 'cpu' "
     "engine takes merged weights: set merge=true or actor_rollout_ref.rollout.name=sglang"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.merge=false",
      "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.hybrid_engine=false"],
     "adapter-only sync across the separate placement is not built; set merge=true"),
    (["critic.model.lora.rank=8"], "unknown key 'critic.model.lora.rank'"),  # the critic trains full weights
])
def test_lora_errors_are_one_line_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_lora_target_names_map_to_hf_projections():
    from mppo.config.lora import check_lora_model, lora_projections

    assert lora_projections(["linear_qkv", "linear_fc2"], []) == ("q_proj", "k_proj", "v_proj", "down_proj")
    assert lora_projections(["all-linear"], ["linear_fc1", "q_proj"]) == ("k_proj", "v_proj", "o_proj",
                                                                          "down_proj")
    assert lora_projections(["o_proj", "gate_proj"], []) == ("o_proj", "gate_proj")
    cfg = load_config(None, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.target_modules=all-linear"])
    assert cfg.actor_rollout_ref.model.lora.target_modules == ["all-linear"]
    check_lora_model(cfg, "qwen2", is_moe=False)
    check_lora_model(cfg, "qwen3_moe", is_moe=True)  # experts adapted at TP 1 (whole experts), merged
    for extra, message in (
            (["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], "built for whole experts, and "
             "expert-TP is 2: set actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"),
            (["actor_rollout_ref.model.lora.merge=false", "actor_rollout_ref.rollout.name=sglang"],
             "adapter-only sync of MoE experts is not built")):
        other = load_config(None, ["actor_rollout_ref.model.lora.rank=8", *extra])
        with pytest.raises(ConfigError, match=message) as err:
            check_lora_model(other, "qwen3_moe", is_moe=True)
        assert "\n" not in str(err.value)
    # attention-only adapters need no whole experts
    attention = load_config(None, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora."
                                   "target_modules=[linear_qkv]", "actor_rollout_ref.actor.megatron."
                                   "tensor_model_parallel_size=2"])
    check_lora_model(attention, "qwen3_moe", is_moe=True)
