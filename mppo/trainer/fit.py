"""The PPO fit loop: one readable pass through veRL's steps per iteration.

    weights → engine ─► rollout (n per prompt) ─► old log-probs ─► ref log-probs ─► values ─► rewards
        ─► KL in reward (or as a loss) ─► advantages ─► critic update ─► actor update ─► metrics, val, checkpoint

On-policy steps (one epoch over one mini-batch) skip the separate old-log-prob pass when nothing needs the old
log-probs before the actor update: the update's own forward is the old policy's, so it supplies them
(`actor.reuse_on_policy_log_prob`, see `old_log_prob_reuse`).

Every rank runs this same program (SPMD). Rollout goes through mppo.rollout.factory's `Rollout` (engines on
rollout groups independent of the trainer's layout, and the memory choreography around generation); the trainer
keeps its data-parallel (DP) rows of the global responses, and within a model-parallel group (the TP×PP ranks of
one DP index) the first rank scores them and shares the batch. Advantages are computed on the whole global batch,
gathered over DP, so batch-wide statistics (GAE whitening, GRPO groups, the KL controller) are exactly veRL's
whatever the layout.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mppo import core_algos
from mppo.config import ConfigError, MppoConfig, to_yaml
from mppo.config.decisions import old_log_prob_pass, old_log_prob_reuse
from mppo.data.loader import PromptBatch
from mppo.errors import UserError
from mppo.parallel import collective_device
from mppo.rollout.agent_loop import build_agent_loop
from mppo.rollout.factory import Rollout, build_rollout
from mppo.trainer import components, faults, remax, response_shaping, rollout_correction
from mppo.trainer.dynamic_sampling import DynamicSampler
from mppo.trainer.checkpoint import CheckpointManager
from mppo.trainer.metrics import (UNREJECTED_MASK, MetricsLogger, StepTimer, compute_data_metrics, perf_metrics,
                                  plot_metrics, tool_call_metrics)
from mppo.trainer.model_flops import ppo_step_flops
from mppo.trainer.parallel_io import ModelParallelIO
from mppo.trainer.rollout_batch import all_gather_rows, build_rollout_batch, local_rows
from mppo.trainer.validation import validate
from mppo.trainer.watchdog import StallWatchdog, process_group_timeout_s, tie_checkpoint_helpers_to_rank

log = logging.getLogger("mppo")

# Tensors gathered over DP so advantages see the whole global batch.
_ADV_INPUTS = ("token_level_scores", "old_log_probs", "ref_log_prob", "values", "response_mask", "uid",
               "rollout_log_probs", "reward_baselines", "sum_pi_squared", "responses", "num_tool_calls")


class NonFiniteUpdatesError(UserError, FloatingPointError):
    """Too many consecutive steps had a NaN/inf loss or gradient norm (trainer.max_consecutive_skips)."""


class PPOTrainer:
    """One run of `cfg`. `rollout`: a Rollout of this launch to use instead of starting engines (tests build several
    trainers one after another on one set of engines, whose start-up is the slow part); it must have been built
    for the same rollout config and model architecture, and its owner shuts it down. None: the trainer builds the
    launch's Rollout and shuts it down at the end of fit()."""

    def __init__(self, cfg: MppoConfig, rollout: Rollout | None = None) -> None:
        from mppo.parallel import init_distributed
        from mppo.workers.actor import ActorWorker
        from mppo.workers.critic import CriticWorker
        from mppo.workers.offload import TrainerStateOffload
        from mppo.workers.reference import ReferenceWorker
        from mppo.workers.worker_checkpoint import load_worker_checkpoint, save_worker_checkpoint

        self._save_worker, self._load_worker = save_worker_checkpoint, load_worker_checkpoint

        self.cfg = cfg
        arr = cfg.actor_rollout_ref
        mcfg = arr.actor.megatron
        _check_shared_layout(cfg)
        # Bad input stops the run here, in seconds: before megatron is imported or any model is built.
        components.check_gpu_packages(cfg)
        components.check_device(cfg)
        components.check_models(cfg)
        self.data = components.build_data(cfg)
        self.agent = build_agent_loop(cfg, self.data.tokenizer)  # rollout.multi_turn (None: single-turn)
        self.faults = faults.from_env()  # None unless MPPO_FAULT is set (tests)
        self.dims = init_distributed(mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size,
                                     mcfg.virtual_pipeline_model_parallel_size, ep=mcfg.expert_model_parallel_size,
                                     timeout_s=process_group_timeout_s(cfg.trainer.collective_timeout_s),
                                     seed=mcfg.seed)
        self.device = torch.device(self.dims.device)
        self.is_main = self.dims.rank == 0
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.io = ModelParallelIO(self.dims)
        self.watchdog = StallWatchdog(cfg.trainer.collective_timeout_s, self.dims.rank)
        tie_checkpoint_helpers_to_rank()  # no orphan processes when this rank is killed
        self.ckpt = CheckpointManager(self.run_dir, resume_config=_resume_config(cfg),
                                      layout={"tp": self.dims.tp, "pp": self.dims.pp, "dp": self.dims.dp,
                                              "vpp": self.dims.vpp, "ep": self.dims.ep},
                                      max_to_keep=cfg.trainer.max_ckpt_to_keep)
        self.ckpt.remove_partial_writes()
        # A checkpoint of another model or config stops the run now, before the models are built.
        self.resume_from = self.ckpt.latest() if cfg.trainer.resume_mode != "disable" else None

        self.total_steps = _total_steps(cfg, len(self.data.train_loader))
        model_path, n = arr.model.path, arr.rollout.n
        self.reuse_old_log_prob, why_not = old_log_prob_reuse(cfg)
        self.old_log_prob_pass = old_log_prob_pass(cfg)
        self.rollout_corr = rollout_correction.RolloutCorrector(cfg, self.io.dp_group,
                                                                reuse_old_log_prob=self.reuse_old_log_prob)
        self.actor = ActorWorker(arr.model, arr.actor, self.dims, model_path, total_steps=self.total_steps,
                                 rollout_n=n, rollout_correction=self.rollout_corr.params)
        self.use_critic = bool(cfg.critic.enable)
        self.critic = (CriticWorker(arr.model, cfg.critic, self.dims, cfg.critic.model.path,
                                    total_steps=self.total_steps, rollout_n=n) if self.use_critic else None)
        self.use_kl_in_reward = cfg.algorithm.use_kl_in_reward
        self.use_ref = self.use_kl_in_reward or arr.actor.use_kl_loss
        if (arr.actor.reuse_on_policy_log_prob or self.rollout_corr.bypass) and self.is_main:
            log.info("old log-probs: %s", "from the rollout engine (rollout correction bypass mode)"
                     if self.rollout_corr.bypass else "from the actor update's forward (on-policy step)"
                     if self.reuse_old_log_prob else f"recomputed before the update: {why_not}")
        # With dynamic batch sizes the reference splits by the actor's token budget (as veRL's ref follows the
        # actor's log_prob_use_dynamic_bsz); otherwise by ref.log_prob_micro_batch_size_per_gpu.
        ref_budget = arr.actor.ppo_max_token_len_per_gpu if arr.actor.use_dynamic_bsz else None
        # veRL's actor log-prob pass splits by rollout.log_prob_micro_batch_size_per_gpu (token budget: the update's)
        self.old_log_prob_micro_batch = (None if arr.actor.use_dynamic_bsz
                                         else arr.rollout.log_prob_micro_batch_size_per_gpu)
        self.ref = (ReferenceWorker(arr.model, arr.ref, self.dims, model_path, logprob_impl=arr.actor.logprob_impl,
                                    kernel_backend=arr.actor.kernel_backend, max_token_len=ref_budget)
                    if self.use_ref else None)
        self.num_parameters = _count_parameters(self.actor.model, self.io)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.get_kl_controller(kc.type, kc.kl_coef, target_kl=kc.target_kl,
                                                    horizon=kc.horizon)
        offload = [("actor", self.actor.model, self.actor.optimizer, mcfg.param_offload, mcfg.optimizer_offload)]
        if self.critic is not None:
            c = cfg.critic.megatron
            offload.append(("critic", self.critic.model, self.critic.optimizer, c.param_offload, c.optimizer_offload))
        if self.ref is not None:
            offload.append(("ref", self.ref.model, None, arr.ref.megatron.param_offload, False))
        self.trainer_state = TrainerStateOffload(offload, self.device)
        # The engines start after the models, with the state that every rollout phase offloads already offloaded:
        # SGLang sizes its KV cache from the memory free at its start, which is then what each rollout phase has.
        # They are released at once, until the first weight sync.
        self._owns_rollout = rollout is None
        if rollout is None:
            self.trainer_state.offload()
            with self.watchdog.phase("start_rollout", 0):
                rollout = build_rollout(cfg, device=self.device, dtype=self.actor.dtype,
                                        log_dir=self.run_dir / "rollout")
            self.trainer_state.reload()
        elif (rollout.name, rollout.layout.engine_tp) != (arr.rollout.name, arr.rollout.tensor_model_parallel_size):
            raise ValueError(f"the Rollout given is {rollout.name} with engine TP {rollout.layout.engine_tp}; this "
                             f"config asks for {arr.rollout.name} with TP {arr.rollout.tensor_model_parallel_size}")
        self.rollout = rollout
        self.train_sampling = components.train_sampling(cfg, self.data.tokenizer)
        self.val_sampling = components.val_sampling(cfg, self.data.tokenizer)
        # What the estimator declared it needs beyond rewards and mask (validation checked they can be produced).
        self.estimator_needs = core_algos.estimator_spec(cfg.algorithm.adv_estimator).needs
        self.dynamic_sampler = DynamicSampler(self) if cfg.algorithm.filter_groups.enable else None

        self.metrics = MetricsLogger(self.run_dir, cfg.trainer.logger, enabled=self.is_main,
                                     project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name)
        self.step = 0
        self.consecutive_skips = 0
        self.skipped_steps = 0
        if self.is_main:
            (self.run_dir).mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))

    # ------------------------------------------------------------------------------------------------ resume
    def maybe_resume(self) -> None:
        info = self.resume_from
        if info is None:
            return
        with self.watchdog.phase("load_checkpoint", info.step):
            state = self.ckpt.load_trainer_state(info)
            self._load_worker(self.actor, info.path / "actor")
            if self.critic is not None:
                self._load_worker(self.critic, info.path / "critic")
        self.data.train_loader.load_state_dict(state["data"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.step = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self.metrics.truncate_after(self.step)
        log.info("resumed from %s (step %d)", info.path, self.step)

    def save_checkpoint(self) -> None:
        # The tokenizer files and generation_config.json go with each model, so `mppo convert mcore-to-hf` of a
        # step's actor/ gives a directory that loads and generates as is.
        model = self.cfg.actor_rollout_ref.model
        tokenizer_dir = model.tokenizer_path or model.path
        writers = {"actor": lambda d: self._save_worker(self.actor, d, tokenizer_dir=tokenizer_dir)}
        if self.critic is not None:
            writers["critic"] = lambda d: self._save_worker(self.critic, d, tokenizer_dir=tokenizer_dir)
        state = {"step": self.step, "data": self.data.train_loader.state_dict(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "skipped_steps": self.skipped_steps,
                 "consecutive_skips": self.consecutive_skips}
        fault_hook = self.faults.checkpoint_hook(self.step) if self.faults else None
        with self.watchdog.phase("save_checkpoint", self.step):
            path = self.ckpt.save(self.step, writers, state, fault_hook=fault_hook)
        log.info("checkpoint written: %s", path)

    # ------------------------------------------------------------------------------------------------ one step
    def sync_weights(self) -> dict[str, float]:
        """Actor weights → every engine, resharded to HF layout and streamed in buckets; then trainer state offload
        and the engines' KV cache back (mppo.rollout.factory). A collective on every rank; `release()` after."""
        bucket_bytes = self.cfg.actor_rollout_ref.rollout.weight_bucket_mb << 20
        stats = self.rollout.sync_weights(self.actor.model, self.actor.hf_args, bucket_bytes=bucket_bytes,
                                          trainer_state=self.trainer_state)
        return {"perf/weight_sync_bytes": float(stats.bytes), "perf/weight_sync_gb_per_s": stats.bytes_per_s / 1e9}

    def generate(self, prompts: PromptBatch, first_index: int, sampling, step: int) -> dict[str, torch.Tensor]:
        """Rollout of the GLOBAL `prompts` (global indices from `first_index`) over every engine; this DP rank's
        rows are scored on its model-parallel leader and broadcast to the group."""
        prompt_ids = [row[mask.bool()].tolist() for row, mask in zip(prompts.input_ids, prompts.attention_mask)]
        responses = self.rollout.generate(prompt_ids, sampling, step=step, first_index=first_index, agent=self.agent)
        prompts, offset = self.io.dp_slice(prompts)
        n = sampling.n
        responses = responses[offset * n:(offset + len(prompts)) * n]
        batch = None
        if self.io.is_leader:
            batch = build_rollout_batch(prompts, responses, n=n, max_response_length=self.cfg.data.max_response_length,
                                        pad_token_id=self.data.tokenizer.pad_token_id)
            scores, reward_metrics = self.data.reward(
                [p for p in prompts.raw_prompts for _ in range(n)], batch["responses"], batch["response_mask"],
                [s for s in prompts.data_sources for _ in range(n)],
                [g for g in prompts.ground_truths for _ in range(n)],
                [e for e in prompts.extra_infos for _ in range(n)])
            batch["token_level_scores"] = scores
            batch["reward_errors"] = torch.tensor([reward_metrics.get("reward/errors", 0.0)])
        return self.io.broadcast_from_leader(batch)

    def train_rollout(self, prompts: PromptBatch, first_index: int) -> dict[str, torch.Tensor]:
        """This DP rank's rows of the training rollout of the GLOBAL `prompts` (global indices from `first_index`),
        scores shaped, with ReMax's greedy baselines when the estimator needs them."""
        batch = self.generate(prompts, first_index, self.train_sampling, self.step)
        response_shaping.shape_scores(self.cfg, batch)
        if "reward_baselines" in self.estimator_needs:
            batch["reward_baselines"] = remax.reward_baselines(self, prompts, first_index, self.step)
        return batch

    def train_step(self, prompts: PromptBatch,
                   more_prompts: Callable[[], PromptBatch] | None = None) -> dict[str, float]:
        """One PPO step on `prompts`; with dynamic sampling (algorithm.filter_groups) `more_prompts` gives the
        further generation batches (none: the first batch is all there is)."""
        cfg, timer = self.cfg, StepTimer()
        with self.phase(timer, "step"):
            with self.phase(timer, "weight_sync"):
                sync_metrics = self.sync_weights()
            with self.phase(timer, "gen"):
                if self.dynamic_sampler is not None:
                    batch, sampling_metrics = self.dynamic_sampler.collect(prompts, more_prompts)
                else:
                    batch, sampling_metrics = self.train_rollout(prompts, 0), {}
                self.rollout.release()
            temperature = cfg.actor_rollout_ref.rollout.temperature
            rollout_metrics: dict[str, float] = {}
            if self.rollout_corr.bypass:  # rollout correction's bypass mode: the engine's log-probs are the old ones
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif self.old_log_prob_pass:
                with self.phase(timer, "old_log_prob"):
                    outs = self.actor.compute_log_prob_outputs(
                        batch, temperature=temperature, micro_batch_size=self.old_log_prob_micro_batch,
                        calculate_sum_pi_squared=bool(cfg.actor_rollout_ref.actor.calculate_sum_pi_squared))
                    batch["old_log_probs"] = outs["log_probs"]
                    if "sum_pi_squared" in outs:
                        batch["sum_pi_squared"] = outs["sum_pi_squared"]
                rollout_metrics.update(rollout_correction.mismatch_metrics(batch, self.io.dp_group))
            if self.ref is not None:
                with self.phase(timer, "ref"):
                    batch["ref_log_prob"] = self.ref.compute_log_prob(batch, temperature=temperature)
            if self.critic is not None:
                with self.phase(timer, "values"):
                    batch["values"] = self.critic.compute_values(batch)
            with self.phase(timer, "adv"):
                adv_metrics = self.compute_advantages(batch)
            if self.faults:
                self.faults.poison_update_inputs(batch, self.step + 1)
            # Worker metrics are global (identical on every rank); `skipped` marks a non-finite update.
            metrics: dict[str, float] = {**adv_metrics, **sync_metrics, **sampling_metrics}
            if self.critic is not None:
                with self.phase(timer, "update_critic"):
                    critic_metrics = self.critic.update(batch)
                metrics["critic/skipped"] = float(critic_metrics.pop("skipped", False))
                metrics.update(critic_metrics)
            if self.step >= cfg.trainer.critic_warmup:
                with self.phase(timer, "update_actor"):
                    actor_metrics = self.actor.update(batch, temperature=temperature,
                                                      old_log_prob_from_update=self.reuse_old_log_prob)
                metrics["actor/skipped"] = float(actor_metrics.pop("skipped", False))
                metrics.update(actor_metrics)
                rollout_metrics.update(self.rollout_corr.after_update(batch, self.actor.forward_log_probs))
            metrics.update(rollout_metrics)
        with self.watchdog.phase("metrics", self.step + 1):
            metrics.update(self._step_metrics(batch, timer))
        return metrics

    @contextmanager
    def phase(self, timer: StepTimer, name: str) -> Iterator[None]:
        """A timed phase of the step being computed, under the stall watchdog (and MPPO_FAULT, when set)."""
        with self.watchdog.phase(name, self.step + 1), timer.phase(name):
            if self.faults:
                self.faults.at_phase(name, self.step + 1)
            yield

    def compute_advantages(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """KL penalty and advantages on the whole global batch (gathered over DP), then this rank's rows back."""
        cfg = self.cfg.algorithm
        # On the CPU, whatever device the workers computed on: these are [B, T] bookkeeping tensors.
        full = {k: all_gather_rows(batch[k].cpu(), self.io.dp_group) for k in _ADV_INPUTS if k in batch}
        metrics: dict[str, float] = {}
        if self.use_kl_in_reward:
            full["token_level_rewards"], metrics = core_algos.apply_kl_penalty(
                full["token_level_scores"], full["old_log_probs"], full["ref_log_prob"], full["response_mask"],
                self.kl_ctrl, kl_penalty=cfg.kl_penalty)
        else:
            full["token_level_rewards"] = full["token_level_scores"]
        corr_metrics, corrected = self.rollout_corr.before_advantages(full)  # IS weights, rejection: after the KL
        metrics.update(corr_metrics)
        sampling = self.train_sampling
        trunc_metrics, masked = response_shaping.mask_truncated(
            self.cfg, full, () if sampling.ignore_eos else sampling.stop_token_ids)
        metrics.update(trunc_metrics)
        corrected = tuple(dict.fromkeys((*corrected, *masked)))
        full["advantages"], full["returns"] = core_algos.compute_advantage(
            cfg.adv_estimator, token_level_rewards=full["token_level_rewards"], response_mask=full["response_mask"],
            values=full.get("values"), index=full["uid"].numpy().astype(object), gamma=cfg.gamma, lam=cfg.lam,
            norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo, old_log_probs=full.get("old_log_probs"),
            reward_baselines=full.get("reward_baselines"), sum_pi_squared=full.get("sum_pi_squared"),
            rollout_is_weights=full.get("rollout_is_weights"))
        for key in ("token_level_rewards", "advantages", "returns", *corrected):
            batch[key] = local_rows(full[key], self.io.dp_group)
        self._full_batch = full  # for data metrics
        return metrics

    def _step_metrics(self, batch: dict[str, torch.Tensor], timer: StepTimer) -> dict[str, float]:
        full = dict(self._full_batch)
        full["prompt_mask"] = all_gather_rows(batch["prompt_mask"], self.io.dp_group)
        metrics = compute_data_metrics(full, max_response_length=self.cfg.data.max_response_length,
                                       max_prompt_length=self.cfg.data.max_prompt_length)
        metrics.update(timer.metrics())
        metrics.update(response_shaping.overlong_metrics(self.cfg, full))
        metrics.update(tool_call_metrics(full))
        # the tokens the policy generated (before rollout-correction rejection) are what each pass computes on
        response_tokens = int(full.get(UNREJECTED_MASK, full["response_mask"]).sum().item())
        num_tokens = int(full["prompt_mask"].sum().item()) + response_tokens
        self.step_flops = ppo_step_flops(self.actor.hf_args, prompt_tokens=num_tokens - response_tokens,
                                         response_tokens=response_tokens, use_critic=self.use_critic,
                                         use_ref=self.use_ref, old_log_prob_pass=self.old_log_prob_pass)
        metrics.update(perf_metrics(num_tokens=num_tokens, step_seconds=timer.seconds["step"],
                                    world_size=self.dims.world, flops=self.step_flops, device=self.device))
        errors = all_gather_rows(batch["reward_errors"], self.io.dp_group)
        metrics["reward/errors"] = float(errors.sum().item())
        return metrics

    # ------------------------------------------------------------------------------------------------ the loop
    def fit(self) -> None:
        from tqdm import tqdm

        self.maybe_resume()
        cfg = self.cfg.trainer
        if cfg.val_before_train and self.step == 0 and self.data.val_dataset is not None:
            self.metrics.log(0, self.validate())
        bar = tqdm(total=self.total_steps, initial=self.step, desc="ppo", disable=not self.is_main,
                   dynamic_ncols=True)
        loader = self.data.train_loader
        batches = _endless(loader)  # one stream: dynamic sampling may take several batches in a step
        while self.step < self.total_steps:
            metrics = self.train_step(next(batches), more_prompts=lambda: next(batches))
            self.step += 1
            self._count_skips(metrics)
            metrics["training/epoch"] = loader.epoch
            last = self.step >= self.total_steps
            if self.data.val_dataset is not None and cfg.test_freq > 0 and (
                    self.step % cfg.test_freq == 0 or last):
                metrics.update(self.validate())
            self.metrics.log(self.step, metrics)
            self._stop_if_diverging()
            bar.update(1)
            bar.set_postfix({k.split("/", 1)[-1]: f"{metrics[k]:.3g}" for k in
                             ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "response_length/mean")
                             if k in metrics}, refresh=False)
            if (cfg.save_freq > 0 and self.step % cfg.save_freq == 0) or last:
                self.save_checkpoint()
        bar.close()
        if self._owns_rollout:
            self.rollout.shutdown()
        self.watchdog.close()
        self.metrics.close()
        if self.is_main and self.metrics.path.exists():
            png = plot_metrics(self.metrics.path, self.run_dir / "metrics.png")
            log.info("done: %d steps; metrics in %s, plot in %s", self.step, self.metrics.path, png)

    def validate(self) -> dict[str, float]:
        with self.watchdog.phase("validate", self.step):
            return validate(self, self.data.val_dataset)

    def _count_skips(self, metrics: dict[str, float]) -> None:
        """Count steps whose update was skipped for a NaN/inf loss or grad norm (`training/skipped_steps`)."""
        skipped = bool(metrics.get("actor/skipped", 0.0)) or bool(metrics.get("critic/skipped", 0.0))
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        self.skipped_steps += int(skipped)
        metrics["training/skipped_steps"] = self.skipped_steps
        if skipped:
            log.warning("step %d: non-finite loss or grad norm, update skipped (%d in a row)", self.step,
                        self.consecutive_skips)

    def _stop_if_diverging(self) -> None:
        limit = self.cfg.trainer.max_consecutive_skips
        if self.consecutive_skips and self.consecutive_skips >= limit:
            raise NonFiniteUpdatesError(
                f"stopped at step {self.step}: {self.consecutive_skips} consecutive steps had a NaN/inf loss or grad "
                f"norm and were skipped (trainer.max_consecutive_skips={limit}); the weights are those of the last "
                f"good step and the last checkpoint is in {self.ckpt.root}. Lower the learning rate, or check the "
                "rewards and data of these steps (metrics.jsonl)")


def _endless(loader) -> Iterator[PromptBatch]:
    """The loader's batches epoch after epoch (its state always says what was handed out)."""
    while True:
        yield from loader


def _count_parameters(model_chunks, io: ModelParallelIO) -> int:
    """Parameters of the whole model: this rank's shard summed over its model-parallel group; a MoE model's routed
    experts (megatron marks them `allreduce=False`) are split over EP ranks outside that group, EP x as many."""
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    local = sum(p.numel() * (ep if not getattr(p, "allreduce", True) else 1)
                for chunk in model_chunks for p in chunk.parameters())
    total = torch.tensor([local], dtype=torch.float64, device=collective_device(io.mp_group))
    if io.mp_group is not None:
        dist.all_reduce(total, group=io.mp_group)
    return int(total.item())


def _check_shared_layout(cfg: MppoConfig) -> None:
    """Actor, critic and reference share megatron's one set of process groups, so they share one layout."""
    actor = cfg.actor_rollout_ref.actor.megatron
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size")
    for role, section in (("critic", cfg.critic.megatron), ("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron)):
        for key in keys:
            if getattr(section, key) != getattr(actor, key):
                raise ConfigError(f"{role}.megatron.{key}={getattr(section, key)} differs from the actor's "
                                  f"{getattr(actor, key)}; mppo runs all models on one layout: leave it null")


def _total_steps(cfg: MppoConfig, batches_per_epoch: int) -> int:
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    return cfg.trainer.total_epochs * batches_per_epoch


# Keys a resumed run may change without changing what it computes.
_RESUME_FREE = ("trainer.total_epochs", "trainer.total_training_steps", "trainer.save_freq", "trainer.test_freq",
                "trainer.logger", "trainer.max_ckpt_to_keep", "trainer.collective_timeout_s",
                "trainer.val_before_train", "trainer.project_name", "trainer.experiment_name",
                "trainer.resume_mode", "trainer.max_consecutive_skips", "trainer.default_local_dir",
                "data.val_files", "data.val_batch_size", "actor_rollout_ref.actor.reuse_on_policy_log_prob",
                # where memory goes around the rollout (the engine's share; offloads restore bitwise): what a run
                # that ran out of memory changes before it resumes
                "actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.free_cache_engine",
                *(f"{role}.megatron.{key}" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
                  for key in ("param_offload", "optimizer_offload")))


def _resume_config(cfg: MppoConfig) -> dict[str, Any]:
    from dataclasses import asdict

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
        flat.update({f"{prefix}.config_json.{k}": v for k, v in components.model_facts(path).items()})
    return {k: v for k, v in flat.items()
            if not any(k == free or k.startswith(free + ".") for free in _RESUME_FREE)
            and ".val_kwargs." not in k}


def run(cfg: MppoConfig) -> int:
    trainer = PPOTrainer(cfg)
    trainer.fit()
    return 0
