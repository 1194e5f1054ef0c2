"""The typed schema of an mppo run: one dataclass per config section, defaults = veRL 0.9.1's where veRL has one.

Key names follow veRL/TinyZero so their command lines carry over. A field whose default is `None` and that is
listed in `INHERITED_FROM` means "same as its parent key"; `mppo.config.resolve` fills it in, so a loaded config
never contains those nulls. `configs/ppo_trainer.yaml` mirrors these defaults key for key (a test keeps them equal).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

from mppo.errors import UserError


class ConfigError(UserError, ValueError):
    """A user mistake in a config file or override; the message is the one line the user sees."""


def choice(default: str, *others: str) -> Any:
    """A str field whose value must be one of (default, *others); validate() checks it."""
    return field(default=default, metadata={"choices": (default, *others)})


# ----------------------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    train_files: Optional[List[str]] = None  # training parquet file(s), veRL row format; one path or a list
    val_files: Optional[List[str]] = None  # validation parquet file(s); null: no validation
    train_batch_size: int = 1024  # prompts per PPO step (each sampled rollout.n times)
    gen_batch_size: Optional[int] = None  # prompts per generation batch (dynamic sampling); null: train_batch_size
    val_batch_size: Optional[int] = None  # prompts per validation batch; null: the whole validation set at once
    max_prompt_length: int = 512  # tokens; longer prompts are filtered or rejected (filter_overlong_prompts)
    max_response_length: int = 512  # tokens generated per response at most
    prompt_key: str = "prompt"  # dataset column holding the chat-message prompt
    filter_overlong_prompts: bool = False  # true: drop prompts > max_prompt_length (counted); false: error
    shuffle: bool = True  # shuffle the training set every epoch
    seed: Optional[int] = None  # shuffling seed; null: trainer.seed


# ---------------------------------------------------------------------------------------------- actor/rollout/ref
@dataclass
class LoRAConfig:
    # veRL's Megatron LoRA keys; adapters on the actor's linears, the base frozen (mppo.models.lora)
    rank: int = 0  # adapter rank; 0 = off (full fine-tuning)
    alpha: float = 32.0  # the adapter output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout)
    # megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2), HF names (q_proj ... down_proj), all-linear
    target_modules: List[str] = field(
        default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    exclude_modules: List[str] = field(default_factory=list)  # the same names, taken out of target_modules
    merge: bool = True  # rollout: stream base + adapters merged to the engine; false: the base once, then adapters only (SGLang)


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF model directory (config.json + safetensors); required to train
    tokenizer_path: Optional[str] = None  # tokenizer directory; null: model.path
    trust_remote_code: bool = False  # allow custom modelling code shipped with the checkpoint
    # layer spec: auto = Transformer Engine if usable on GPU, else sdpa (megatron's local layers with fused SDPA
    # attention); local = megatron's unfused attention (materialises [heads, s, s] scores; a reference)
    transformer_impl: str = choice("auto", "te", "sdpa", "local")
    dtype: str = choice("auto", "fp32", "bf16")  # parameter dtype; auto = bf16 on cuda, fp32 on cpu
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA adapters instead of full-weight training


@dataclass
class OptimConfig:
    lr: float = 1e-6  # peak learning rate
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam (beta1, beta2)
    eps: float = 1e-8  # Adam epsilon
    clip_grad: float = 1.0  # max global grad norm; 0 disables clipping
    lr_warmup_steps: int = -1  # linear warm-up length in optimizer steps; -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # warm-up as a fraction of total optimizer steps (when lr_warmup_steps=-1)
    lr_scheduler: str = choice("constant", "cosine")  # LR after warm-up: constant, or cosine decay to min_lr_ratio
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr


RECOMPUTE = ("none", "selective", "full")  # none; selective = attention core only; full = whole layers


@dataclass
class TransformerOverrides:
    # megatron TransformerConfig fields set on top of mppo's (veRL's override_transformer_config); MoE models only
    moe_aux_loss_coeff: Optional[float] = None  # Switch load-balancing loss x this, added to the loss; 0 = off
    moe_z_loss_coeff: Optional[float] = None  # router z-loss (ST-MoE) x this, added to the loss; 0 = off


@dataclass
class MegatronConfig:
    # For the critic and the reference policy every null here means "same as the actor's".
    tensor_model_parallel_size: Optional[int] = None  # TP: ranks sharding each layer
    pipeline_model_parallel_size: Optional[int] = None  # PP: pipeline stages
    virtual_pipeline_model_parallel_size: Optional[int] = None  # model chunks per stage (interleaved 1F1B); 1 = none
    expert_model_parallel_size: Optional[int] = None  # EP: ranks splitting each MoE layer's experts (from DP)
    sequence_parallel: Optional[bool] = None  # SP: activations split along the sequence over TP; null = on iff TP > 1
    context_parallel_size: Optional[int] = None  # CP: each sequence split over CP ranks (2*CP load-balanced chunks)
    use_distributed_optimizer: Optional[bool] = None  # shard optimizer state over DP ranks (ZeRO-1)
    overlap_grad_reduce: Optional[bool] = None  # DP grad reduction bucket by bucket in the backward; null = on iff NCCL
    overlap_param_gather: Optional[bool] = None  # dist. optimizer: param all-gather in the next forward; null = NCCL
    expert_tensor_parallel_size: Optional[int] = None  # ETP: ranks sharding each routed expert (MoE); null = TP
    recompute: Optional[str] = field(default=None, metadata={"choices": RECOMPUTE})  # activation recomputation
    seed: Optional[int] = None  # model-parallel RNG seed (init, dropout); actor: null = trainer.seed
    param_offload: Optional[bool] = None  # params + grad buffers in host memory while the rollout generates
    optimizer_offload: Optional[bool] = None  # optimizer state in host memory while the rollout generates
    # TransformerConfig overrides (MoE aux losses; the ref never trains, so only the actor and critic use them)
    override_transformer_config: TransformerOverrides = field(default_factory=TransformerOverrides)


def actor_megatron_defaults() -> MegatronConfig:
    return MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                          virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
                          context_parallel_size=1,
                          use_distributed_optimizer=True, recompute="none", seed=None, param_offload=False,
                          optimizer_offload=False,
                          override_transformer_config=TransformerOverrides(moe_aux_loss_coeff=0.0,
                                                                           moe_z_loss_coeff=0.0))


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # policy loss in core_algos.POLICY_LOSS_REGISTRY (vanilla = PPO clip + dual clip)
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of valid tokens whose loss is dropped
    clip_cov_lb: float = 1.0  # clip_cov: lower covariance bound of the candidates
    clip_cov_ub: float = 5.0  # clip_cov: upper covariance bound of the candidates
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of valid tokens given the |log-ratio| penalty
    ppo_kl_coef: float = 0.1  # kl_cov: coefficient of that penalty
    dro_beta: Optional[float] = None  # dro: weight of the quadratic log-ratio penalty; required for loss_mode dro


@dataclass
class RouterReplayConfig:
    # veRL's router_replay (its megatron backend nests it under actor.megatron); MoE models only
    mode: str = choice("disabled", "R3")  # R3: the actor replays the rollout engine's expert choices of every token
    # in its old-log-prob and update forwards (the CPU engine records them)


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)  # actor optimizer
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n samples), over all DP ranks
    ppo_micro_batch_size_per_gpu: int = 4  # samples per forward/backward on one DP rank (veRL: null = required)
    use_dynamic_bsz: bool = False  # pack micro-batches by token budget instead of by count
    ppo_max_token_len_per_gpu: int = 16384  # tokens per micro-batch when use_dynamic_bsz
    ppo_epochs: int = 1  # passes over each step's rollouts
    shuffle: bool = False  # shuffle samples between mini-batches
    reuse_on_policy_log_prob: bool = True  # 1 epoch + 1 mini-batch: old log-probs = the update's forward, detached
    clip_ratio: float = 0.2  # PPO clip epsilon; default for clip_ratio_low/high
    clip_ratio_low: Optional[float] = None  # ratio lower clip 1-low; null: clip_ratio
    clip_ratio_high: Optional[float] = None  # ratio upper clip 1+high (clip-higher); null: clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages; must be > 1
    tau_pos: float = 1.0  # sapo: gate temperature for positive advantages
    tau_neg: float = 1.05  # sapo: gate temperature for non-positive advantages
    loss_agg_mode: str = "token-mean"  # core_algos.AGG_LOSS_MODES: how token losses become one scalar
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)  # policy loss selection
    entropy_coeff: float = 0.0  # entropy bonus weight (subtracted from the loss)
    use_kl_loss: bool = False  # add KL(actor || ref) to the actor loss (GRPO style)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # core_algos.KL_PENALTY_TYPES estimator for the KL loss
    logprob_impl: str = choice("fused", "naive")  # fused: chunked hidden->logprob kernel; naive: full logits
    kernel_backend: str = choice("auto", "triton", "torch")  # fused kernels: auto = triton on cuda, torch on cpu
    calculate_sum_pi_squared: Optional[bool] = None  # sum_v p^2 per token in the old-log-prob pass; null: iff needed
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)  # MoE routing replay
    megatron: MegatronConfig = field(default_factory=actor_megatron_defaults)  # actor parallel layout


@dataclass
class SamplingConfig:
    do_sample: bool = False  # false: greedy decoding
    temperature: float = 0.0  # sampling temperature (ignored when greedy)
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # top-k cut; -1 disables
    n: int = 1  # responses per validation prompt


@dataclass
class MultiTurnConfig:
    # veRL rollout.multi_turn: an agent loop with tools; tool turns are in the context but out of every loss
    enable: bool = False  # multi-turn rollout: the model may call tools (mppo.rollout.tools) between turns
    max_assistant_turns: Optional[int] = None  # assistant turns per response at most; null: until the length limit
    tool_timeout_s: float = 10.0  # a tool call still running after this many seconds is killed (an error message)
    max_tool_response_length: int = 256  # characters of a tool message kept
    tool_response_truncate_side: str = choice("middle", "left", "right")  # which part of a longer one is kept
    format: str = choice("hermes")  # tool calls: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    tool_max_memory_mb: Optional[int] = 1024  # MiB a tool call may allocate (child RLIMIT_AS); null: no cap (mppo)


@dataclass
class RolloutConfig:
    name: str = choice("sglang", "cpu")  # engine: sglang (GPU, co-located) or the CPU engine (tests, demo)
    n: int = 1  # responses sampled per prompt (GRPO group size)
    temperature: float = 1.0  # sampling temperature; also divides the logits of every log-prob pass
    top_p: float = 1.0  # nucleus sampling mass
    top_k: int = -1  # top-k cut; -1 disables
    ignore_eos: bool = False  # never stop at EOS/stop tokens: every response runs to max_response_length (veRL)
    tensor_model_parallel_size: int = 2  # ranks per engine (within one node)
    gpu_memory_utilization: float = 0.5  # fraction of GPU memory the engine reserves (SGLang mem_fraction_static)
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # samples per old-log-prob forward; null: actor's micro
    weight_bucket_mb: int = 512  # MiB per bucket when streaming weights to the engine
    free_cache_engine: bool = True  # release the engine's weights + KV cache while the trainer trains
    nnodes: int = 1  # hybrid_engine=false: nodes holding engine ranks (veRL fully_async's rollout pool)
    n_gpus_per_node: int = 1  # hybrid_engine=false: engine ranks per such node (mppo.parallel.placement)
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)  # sampling for validation
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # agent loop with tools


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # samples per ref-log-prob forward; null: actor's micro
    offload_to_cpu: bool = False  # keep reference weights on CPU, swap in for its forward
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # layout; nulls: the actor's


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy model
    actor: ActorConfig = field(default_factory=ActorConfig)  # training of the policy
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation
    ref: RefConfig = field(default_factory=RefConfig)  # frozen reference policy (for KL)
    # false: trainer.nnodes x n_gpus_per_node ranks train, rollout.nnodes x n_gpus_per_node generate
    # (mppo.parallel.placement)
    hybrid_engine: bool = True  # true: every rank trains and generates (co-located); false: engine ranks beside


# --------------------------------------------------------------------------------------------------------- critic
@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # HF checkpoint the critic trunk starts from; null: actor_rollout_ref.model.path


def critic_optim_defaults() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # null: on iff the estimator needs values (adv_registry: needs "values")
    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # critic initialisation
    optim: OptimConfig = field(default_factory=critic_optim_defaults)  # critic optimizer
    ppo_mini_batch_size: Optional[int] = None  # prompts per critic optimizer step; null: actor's
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # samples per forward/backward per rank; null: actor's
    use_dynamic_bsz: Optional[bool] = None  # pack by token budget; null: actor's
    ppo_max_token_len_per_gpu: int = 32768  # tokens per micro-batch when use_dynamic_bsz
    ppo_epochs: Optional[int] = None  # passes over each step's rollouts; null: actor's
    cliprange_value: float = 0.5  # value clip range around the old values
    loss_agg_mode: Optional[str] = None  # core_algos.AGG_LOSS_MODES; null: actor's
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # layout; nulls: the actor's


# ------------------------------------------------------------------------------------------------------ algorithm
@dataclass
class KLControlConfig:
    type: str = choice("fixed", "adaptive")  # KL-in-reward coefficient controller
    kl_coef: float = 0.001  # (initial) KL coefficient
    target_kl: float = 0.1  # adaptive: KL the controller steers to
    horizon: int = 10000  # adaptive: samples over which the coefficient adapts


@dataclass
class RolloutCorrectionConfig:
    # veRL 0.9.1 algorithm.rollout_correction: correct for the engine's policy differing from the actor's
    rollout_is: Optional[str] = None  # IS weights: null (off), token, or sequence (one weight per response)
    rollout_is_threshold: Union[str, float] = 2.0  # number: TIS upper bound; 'lower_upper' (e.g. '0.5_5.0'): IcePop
    rollout_is_batch_normalize: bool = False  # divide the IS weights by their global-batch mean
    rollout_rs: Optional[str] = None  # rejection: comma list of token_k1..3, seq_{sum,mean}_k1..3, seq_max_k2..3
    rollout_rs_threshold: Optional[Union[str, float]] = None  # one, or one per rollout_rs entry; k1: 'lower_upper'
    bypass_mode: bool = False  # old log-probs = the engine's (no old-log-prob pass); loss_type picks the loss
    loss_type: str = "ppo_clip"  # bypass mode: ppo_clip (PPO on pi/pi_rollout) or reinforce (IS-weighted PG)


@dataclass
class FilterGroupsConfig:
    # veRL algorithm.filter_groups: DAPO dynamic sampling, drop groups whose responses all score the same
    enable: bool = False  # drop uniform groups and generate more batches until train_batch_size groups are kept
    # per-response value compared: reward, seq_reward = summed score before KL (overlong penalty included);
    # seq_final_reward = summed score after the in-reward KL; acc, score = the reward function's own (before the
    # overlong penalty): a number it returns is acc, a dict return gives its keys (veRL's DAPO reward manager)
    metric: str = choice("reward", "acc", "score", "seq_reward", "seq_final_reward")
    max_num_gen_batches: int = 0  # generation batches per step at most; <= 0: no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # core_algos.ADV_ESTIMATOR_REGISTRY: gae, grpo, rloo, reinforce_plus_plus, ...
    gamma: float = 1.0  # discount factor
    lam: float = 1.0  # GAE lambda
    norm_adv_by_std_in_grpo: bool = True  # GRPO: divide by the group std (false = Dr.GRPO)
    use_kl_in_reward: bool = False  # subtract kl_ctrl.kl_coef * KL(old || ref) from the token rewards
    kl_penalty: str = "kl"  # core_algos.KL_PENALTY_TYPES estimator for the in-reward KL
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)  # in-reward KL coefficient
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)  # TIS/IcePop/rejection
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)  # DAPO dynamic sampling
    mask_truncated_responses: bool = False  # DAPO overlong filtering: length-cut responses out of every loss


# --------------------------------------------------------------------------------------------------------- reward
@dataclass
class CustomRewardFnConfig:
    path: Optional[str] = None  # Python file with a user reward function; null: built-in scorer per data_source
    name: str = "compute_score"  # function name in that file


@dataclass
class OverlongBufferConfig:
    # veRL 0.9.1's DAPO reward manager: penalise responses longer than max_resp_len - len, linearly
    enable: bool = False  # add min(-(length - (max_resp_len - len)) / len * penalty_factor, 0) to each score
    len: int = 4096  # tokens before max_resp_len where the penalty ramps from 0 to -penalty_factor
    penalty_factor: float = 1.0  # penalty at max_resp_len tokens
    log: bool = False  # log reward/overlong_penalty/mean and reward/overlong_ratio


@dataclass
class RewardKwargsConfig:
    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)  # DAPO soft penalty
    max_resp_len: Optional[int] = None  # length the penalty ends at; null: data.max_response_length


@dataclass
class RewardConfig:
    custom_fn: CustomRewardFnConfig = field(default_factory=CustomRewardFnConfig)  # user reward function
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)  # veRL reward_kwargs (DAPO)
    format_score: Optional[float] = None  # score of a well-formed wrong answer; null: each task's own (countdown 0.1)
    max_failed_steps: int = 3  # stop when every response of this many steps in a row failed to score; 0: never


# -------------------------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    total_epochs: int = 30  # passes over the training set
    total_training_steps: Optional[int] = None  # stop after this many PPO steps; null: total_epochs decides
    save_freq: int = -1  # checkpoint every N steps (and at the end); -1: only at the end
    test_freq: int = -1  # validate every N steps (and at the end); -1: never during training
    val_before_train: bool = True  # validate once before the first step
    critic_warmup: int = 0  # steps that update only the critic before the actor starts
    seed: int = 42  # run seed: data order, sampling, init (per-sample seeds derive from it)
    nnodes: int = 1  # nodes in the launch
    n_gpus_per_node: int = 8  # ranks per node (GPUs, or processes on CPU)
    device: str = choice("auto", "cpu", "cuda")  # auto: cuda when available, else cpu (gloo)
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # run dir: ckpts, metrics
    logger: List[str] = field(default_factory=lambda: ["console", "tensorboard"],
                              metadata={"choices": ("console", "tensorboard", "wandb")})  # metric sinks
    project_name: str = "mppo"  # project name (W&B project, run-dir part)
    experiment_name: str = "default"  # experiment name (W&B run, run-dir part)
    resume_mode: str = choice("auto", "disable")  # auto: resume from the latest checkpoint in default_local_dir
    max_ckpt_to_keep: Optional[int] = 2  # keep the newest N checkpoints; null: keep all (veRL's default)
    max_consecutive_skips: int = 3  # stop after this many consecutive steps skipped for NaN/inf
    collective_timeout_s: int = 1800  # seconds a collective phase may take before the run aborts with a report
    rollout_data_dir: Optional[str] = None  # write each step's generations to <dir>/<step>.jsonl; null: off


# ------------------------------------------------------------------------------------------------ async training
@dataclass
class AsyncTrainingConfig:
    # 0: synchronous; 1: one-step off-policy, the engines generate step s+1 while step s trains (hybrid_engine=false)
    max_off_policy_steps: int = 0
    # a weight update interrupts the generation in flight, which goes on on the new weights (CPU engine, k >= 1)
    partial_rollout: bool = False


@dataclass
class MppoConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)  # off-policy pipeline


# ------------------------------------------------------------------------------------------------- inheritance
ACTOR = "actor_rollout_ref.actor"
MEGATRON_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "expert_model_parallel_size", "sequence_parallel",
                 "context_parallel_size",
                 "use_distributed_optimizer", "recompute", "seed", "param_offload", "optimizer_offload",
                 "override_transformer_config.moe_aux_loss_coeff", "override_transformer_config.moe_z_loss_coeff",
                 "overlap_grad_reduce", "overlap_param_gather", "expert_tensor_parallel_size")

# key -> parent key: a null key takes its parent's (resolved) value. critic.enable is resolved separately
# (from the estimator), see resolve().
INHERITED_FROM: dict[str, str] = {
    "data.seed": "trainer.seed",
    "reward.reward_kwargs.max_resp_len": "data.max_response_length",
    "actor_rollout_ref.model.tokenizer_path": "actor_rollout_ref.model.path",
    f"{ACTOR}.clip_ratio_low": f"{ACTOR}.clip_ratio",
    f"{ACTOR}.clip_ratio_high": f"{ACTOR}.clip_ratio",
    f"{ACTOR}.megatron.seed": "trainer.seed",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": f"{ACTOR}.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": f"{ACTOR}.ppo_micro_batch_size_per_gpu",
    "critic.model.path": "actor_rollout_ref.model.path",
    **{f"critic.{k}": f"{ACTOR}.{k}" for k in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                                                "use_dynamic_bsz", "ppo_epochs", "loss_agg_mode")},
    **{f"{role}.megatron.{k}": f"{ACTOR}.megatron.{k}"
       for role in ("actor_rollout_ref.ref", "critic") for k in MEGATRON_KEYS},
}
