"""The PPO fit loop: one readable pass through veRL's steps per iteration.

    weights → engine ─► rollout (n per prompt) ─► reward ─► old log-probs ─► ref log-probs ─► values
        ─► KL penalty in the reward ─► advantages ─► critic update ─► actor update ─► metrics, val, checkpoint

The loop decides nothing: what a config implies (which models exist, where the old log-probs come from, micro-batch
sizes) is decided in mppo.config.decisions, shared with `mppo plan`; what it rejects is checked before it starts, by
mppo.config.validate (the config) and mppo.preflight (the machine and the files), as `mppo train --dry-run` does.
What runs beside the PPO math (the generation dump, fault injection) are step hooks (mppo.trainer.hooks); what an
estimator alone needs of each generation batch (ReMax's baselines) is its input provider
(mppo.trainer.estimator_inputs); the batch's keys are declared in mppo.workers.batch_schema.

Every rank runs this same program (SPMD). Rollout goes through mppo.rollout.factory's `Rollout` (engines on
rollout groups independent of the trainer's layout, and the memory choreography around generation); the trainer
keeps its data-parallel (DP) rows of the global responses, and within a model-parallel group (the TP×PP ranks of
one DP index) the first rank scores them and shares the scores. The KL penalty and advantages are computed on the
whole global batch, gathered over DP, so batch-wide statistics (GAE whitening, GRPO groups, the KL controller) are
exactly veRL's whatever the layout.
"""
from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from mppo import core_algos, preflight
from mppo.config import MppoConfig, to_yaml
from mppo.config.validate_async import engine_world
from mppo.config.decisions import (OldLogProbSource, describe_old_log_prob_source, old_log_prob_micro_batch,
                                   old_log_prob_source)
from mppo.data.loader import PromptBatch
from mppo.errors import UserError
from mppo.parallel import collective_device
from mppo.parallel.placement import ENGINE, Side
from mppo.rewards.manager import reward_function_name
from mppo.rollout.agent_loop import build_agent_loop
from mppo.rollout.base import SamplingParams
from mppo.rollout.factory import Rollout
from mppo.trainer import (components, estimator_inputs, faults, offpolicy, response_shaping, roles,
                          rollout_correction, validation)
from mppo.trainer.dynamic_sampling import DynamicSampler, reward_extra_key
from mppo.trainer.metrics import (MetricsLogger, StepTimer, compute_data_metrics, perf_metrics,
                                  plot_metrics, tool_call_metrics)
from mppo.trainer.model_flops import ppo_step_flops
from mppo.trainer.parallel_io import ModelParallelIO
from mppo.trainer.resume import open_checkpoints
from mppo.trainer.rollout_batch import all_gather_rows, build_rollout_batch, local_rows
from mppo.trainer.hooks import GenerationDump, StepHooks
from mppo.trainer.watchdog import StallWatchdog, process_group_timeout_s
from mppo.workers.batch_schema import FILTER_METRIC, UNREJECTED_MASK, read_by

log = logging.getLogger("mppo")

Batch = dict[str, torch.Tensor]

# Tensors gathered over DP so the KL penalty and advantages see the whole global batch (mppo.workers.batch_schema)
_KL_INPUTS, _ADV_INPUTS = read_by("kl_penalty"), read_by("advantages")
# ... and so the step's data metrics do (taken before anything can change the update's inputs).
_METRIC_INPUTS = read_by("metrics")


class NonFiniteUpdatesError(UserError, FloatingPointError):
    """Too many consecutive steps had a NaN/inf loss or gradient norm (trainer.max_consecutive_skips)."""


class RewardFunctionFailedError(UserError, RuntimeError):
    """Every response of reward.max_failed_steps steps in a row failed to score: the run would learn from zeros."""


class PPOTrainer:
    """One run of `cfg`. `rollout`: a Rollout of this launch to use instead of starting engines (tests build several
    trainers one after another on one set of engines, whose start-up is the slow part); it must have been built
    for the same rollout config and model architecture, and its owner shuts it down. None: the trainer builds the
    launch's Rollout and shuts it down at the end of fit(). `side`: the trainer ranks' side of a separate placement
    (hybrid_engine=false, mppo.trainer.offpolicy.start_side): the Rollout is then a RemoteRollout of its engines."""

    def __init__(self, cfg: MppoConfig, rollout: Rollout | None = None, side: Side | None = None) -> None:
        from mppo.parallel import init_distributed

        self.cfg, mcfg = cfg, cfg.actor_rollout_ref.actor.megatron
        preflight.check_run(cfg)  # bad input stops the run here, in seconds: before megatron is imported
        self.data = components.build_data(cfg)
        self.agent = build_agent_loop(cfg, self.data.tokenizer)  # rollout.multi_turn (None: single-turn)
        injector = faults.from_env()  # None unless MPPO_FAULT is set (tests); a bad value stops the run here
        self.dims = init_distributed(mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size,
                                     mcfg.virtual_pipeline_model_parallel_size, ep=mcfg.expert_model_parallel_size,
                                     etp=mcfg.expert_tensor_parallel_size, cp=mcfg.context_parallel_size,
                                     timeout_s=process_group_timeout_s(cfg.trainer.collective_timeout_s),
                                     seed=mcfg.seed)
        self.device, self.is_main = torch.device(self.dims.device), self.dims.rank == 0
        self.run_dir = Path(cfg.trainer.default_local_dir)
        self.io = ModelParallelIO(self.dims)
        self.watchdog = StallWatchdog(cfg.trainer.collective_timeout_s, self.dims.rank)
        self.ckpt, self.resume_from = open_checkpoints(cfg, self.dims)  # before the models: a wrong one stops here
        self.total_steps = _total_steps(cfg, len(self.data.train_loader))
        self.old_log_prob_source = old_log_prob_source(cfg)
        if self.is_main and describe_old_log_prob_source(cfg):
            log.info("old log-probs: %s", describe_old_log_prob_source(cfg))
        self.rollout_corr = rollout_correction.RolloutCorrector(cfg, self.io.dp_group,
                                                                old_log_prob_source=self.old_log_prob_source)
        models = roles.build_roles(cfg, self.dims, total_steps=self.total_steps,
                                   rollout_correction=self.rollout_corr.params)
        self.actor, self.critic, self.ref, self.trainer_state = models
        self.num_parameters = _count_parameters(self.actor.model, self.io)
        kc = cfg.algorithm.kl_ctrl
        self.kl_ctrl = core_algos.get_kl_controller(kc.type, kc.kl_coef, target_kl=kc.target_kl, horizon=kc.horizon)
        self._owns_rollout = rollout is None
        self.rollout = roles.start_rollout(cfg, rollout, models, self.watchdog, self.run_dir, side=side)
        # k > 0: the engines generate steps s+1 .. s+k while step s trains
        self.off_policy_steps = cfg.async_training.max_off_policy_steps
        self.pipeline = offpolicy.PipelineMetrics()
        self.train_sampling = components.train_sampling(cfg, self.data.tokenizer)
        self.val_sampling = components.val_sampling(cfg, self.data.tokenizer)
        # what the estimator needs of each generation batch beyond its rewards (ReMax's greedy baselines)
        self.reward_inputs = estimator_inputs.reward_stage_providers(
            core_algos.estimator_spec(cfg.algorithm.adv_estimator).needs, rollout_batch=self.rollout_batch,
            reward=self.reward, sampling=self.train_sampling)
        self.dynamic_sampler = self._dynamic_sampler() if cfg.algorithm.filter_groups.enable else None
        self.hooks = self._step_hooks(injector)
        self.metrics = MetricsLogger(self.run_dir, cfg.trainer.logger, enabled=self.is_main,
                                     project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name)
        self.step = self.consecutive_skips = self.skipped_steps = self.consecutive_failed_rewards = 0
        self.reward_last_error: str | None = None  # the scorer's latest failure, as the model-parallel leader saw it
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg))

    def _step_hooks(self, injector: faults.FaultInjector | None) -> StepHooks:
        """The generation dump (trainer.rollout_data_dir) and, in tests, fault injection (MPPO_FAULT): in that
        order, so the dump has the step's real data."""
        hooks = []
        if self.cfg.trainer.rollout_data_dir:
            hooks.append(GenerationDump(self.cfg.trainer.rollout_data_dir, self.data.tokenizer, is_main=self.is_main,
                                        gather_global=self.gather_global))
        return StepHooks(hooks + ([injector] if injector is not None else []))

    def _dynamic_sampler(self) -> DynamicSampler:
        return DynamicSampler(self.cfg, self.io, dataset_size=len(self.data.train_loader.dataset),
                              n=self.train_sampling.n, pad_token_id=self.data.tokenizer.pad_token_id,
                              generation_batch=self.generation_batch,
                              reward_name=reward_function_name(self.data.reward.compute_score))

    # ------------------------------------------------------------------------------------------------ resume
    def maybe_resume(self) -> None:
        info = self.resume_from
        if info is None:
            return
        from mppo.workers.worker_checkpoint import load_worker_checkpoint

        with self.watchdog.phase("load_checkpoint", info.step):
            state = self.ckpt.load_trainer_state(info)
            load_worker_checkpoint(self.actor, info.path / "actor")
            if self.critic is not None:
                load_worker_checkpoint(self.critic, info.path / "critic")
        self.data.train_loader.load_state_dict(state["data"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.step = state["step"]
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self.consecutive_failed_rewards = state.get("consecutive_failed_rewards", 0)
        self.metrics.truncate_after(self.step)
        offpolicy.restore_in_flight(self.rollout, info.path)  # the off-policy pipeline's generation in flight
        log.info("resumed from %s (step %d)", info.path, self.step)

    def save_checkpoint(self, loader_state: dict | None = None) -> None:
        """`loader_state`: the data loader's state to resume from (None: its state now; the off-policy pipeline
        has taken the next step's prompts already, which a resume must hand out again)."""
        from mppo.workers.worker_checkpoint import save_worker_checkpoint

        # The tokenizer files and generation_config.json go with each model, so `mppo convert mcore-to-hf` of a
        # step's actor/ gives a directory that loads and generates as is.
        model = self.cfg.actor_rollout_ref.model
        tokenizer_dir = model.tokenizer_path or model.path
        writers = {"actor": lambda d: save_worker_checkpoint(self.actor, d, tokenizer_dir=tokenizer_dir)}
        if self.critic is not None:
            writers["critic"] = lambda d: save_worker_checkpoint(self.critic, d, tokenizer_dir=tokenizer_dir)
        writers.update(offpolicy.in_flight_writers(self.rollout))  # last: the engines generate while models save
        state = {"step": self.step, "data": loader_state or self.data.train_loader.state_dict(),
                 "kl_ctrl": self.kl_ctrl.state_dict(), "skipped_steps": self.skipped_steps,
                 "consecutive_skips": self.consecutive_skips,
                 "consecutive_failed_rewards": self.consecutive_failed_rewards}
        with self.watchdog.phase("save_checkpoint", self.step):
            path = self.ckpt.save(self.step, writers, state, fault_hook=self.hooks.checkpoint_points(self.step))
        log.info("checkpoint written: %s", path)

    # ------------------------------------------------------------------------------------------------ one step
    def train_step(self, prompts: PromptBatch, more_prompts: Callable[[], PromptBatch] | None = None,
                   next_prompts: Sequence[PromptBatch] = ()) -> dict[str, float]:
        """One PPO step on `prompts`; with dynamic sampling (algorithm.filter_groups) `more_prompts` gives the
        further generation batches (none: the first batch is all there is). `next_prompts` (the off-policy
        pipeline): the next steps', whose generations the engines start (those not asked for yet) once this
        step's rollout is in."""
        timer, metrics, step_start = StepTimer(), {}, time.time()
        temperature = self.cfg.actor_rollout_ref.rollout.temperature
        with self.phase(timer, "step"):
            with self.phase(timer, "weight_sync"):
                metrics.update(self.sync_weights())
            with self.phase(timer, "gen"):
                batch = self.generate_and_reward(prompts, more_prompts, metrics)
            batch_record = getattr(self.rollout, "last_record", None)
            self.prefetch(next_prompts)  # the off-policy pipeline: generated while this step trains
            gen_done = time.time()
            if self.old_log_prob_source is OldLogProbSource.ROLLOUT:  # bypass mode: the engine's are the old ones
                batch["old_log_probs"] = batch["rollout_log_probs"]
            elif self.old_log_prob_source is OldLogProbSource.ACTOR_PASS:  # (UPDATE_FORWARD: the update's forward)
                with self.phase(timer, "old_log_prob"):
                    self.compute_old_log_probs(batch, temperature)
                metrics.update(self.rollout_mismatch_metrics(batch))
            if self.ref is not None:
                with self.phase(timer, "ref"):
                    batch["ref_log_prob"] = self.ref.compute_log_prob(batch, temperature=temperature)
            if self.critic is not None:
                with self.phase(timer, "values"):
                    batch["values"] = self.critic.compute_values(batch)
            with self.phase(timer, "adv"):
                metrics.update(self.kl_penalty(batch))
                metrics.update(self.compute_advantages(batch))
            data = self.gather_global(batch, _METRIC_INPUTS)  # before a hook can change the update's inputs
            for hook in self.hooks:  # the generation dump, fault injection (mppo.trainer.hooks)
                with self.phase(timer, hook.phase) if hook.phase else nullcontext():
                    hook.before_update(self.step + 1, batch, data)
            if self.critic is not None:
                with self.phase(timer, "update_critic"):
                    metrics.update(_update_metrics("critic", self.critic.update(batch)))
            if self.step >= self.cfg.trainer.critic_warmup:
                with self.phase(timer, "update_actor"):
                    metrics.update(_update_metrics("actor", self.actor.update(
                        batch, temperature=temperature,
                        old_log_prob_from_update=self.old_log_prob_source is OldLogProbSource.UPDATE_FORWARD)))
                metrics.update(self.rollout_corr.after_update(batch, self.actor.forward_log_probs))
        with self.watchdog.phase("metrics", self.step + 1):
            metrics.update(self._step_metrics(data, batch, timer))
            if "policy_version" in batch:
                versions = self.gather_global(batch, ("policy_version",))["policy_version"]
                metrics.update(offpolicy.staleness_metrics(versions, self.step))
            if hasattr(self.rollout, "take_records"):  # the engines on their own ranks
                metrics.update(self.pipeline.step(records=self.rollout.take_records(), batch_record=batch_record,
                                                  step_start=step_start, gen_done=gen_done, step_end=time.time()))
        return metrics

    def generate_and_reward(self, prompts: PromptBatch, more_prompts: Callable[[], PromptBatch] | None,
                            metrics: dict[str, float]) -> Batch:
        """This DP rank's rows of the step's rollout, rewarded; with dynamic sampling (DAPO) more generation
        batches until enough groups have signal. The engines are released after."""
        batch, rows = self.rollout_batch(prompts, 0, self.train_sampling)
        self.train_reward(batch, rows, prompts, 0)
        if self.dynamic_sampler is not None:
            batch, sampling_metrics = self.dynamic_sampler.collect(batch, more_prompts, step=self.step + 1)
            metrics.update(sampling_metrics)
        self.rollout.release()
        return batch

    def prefetch(self, next_prompts: Sequence[PromptBatch]) -> None:
        """Ask the engines for the next steps' generations (the off-policy pipeline; none asked twice)."""
        for ahead, upcoming in enumerate(next_prompts, start=1):
            self.rollout.prefetch(offpolicy.prompt_ids(upcoming.input_ids, upcoming.attention_mask),
                                  self.train_sampling, step=self.step + ahead)

    @contextmanager
    def phase(self, timer: StepTimer, name: str) -> Iterator[None]:
        """A timed phase of the step being computed, under the stall watchdog (and MPPO_FAULT, when set)."""
        with self.watchdog.phase(name, self.step + 1), timer.phase(name):
            self.hooks.on_phase(name, self.step + 1)
            yield

    def sync_weights(self) -> dict[str, float]:
        """Actor weights → every engine, resharded to HF layout and streamed in buckets; then trainer state offload
        and the engines' KV cache back (mppo.rollout.factory). A collective on every rank; `release()` after."""
        bucket_bytes = self.cfg.actor_rollout_ref.rollout.weight_bucket_mb << 20
        stats = self.rollout.sync_weights(self.actor.model, self.actor.hf_args, bucket_bytes=bucket_bytes,
                                          trainer_state=self.trainer_state, version=self.step)
        return {"perf/weight_sync_bytes": float(stats.bytes), "perf/weight_sync_gb_per_s": stats.bytes_per_s / 1e9}

    def rollout_batch(self, prompts: PromptBatch, first_index: int, sampling: SamplingParams
                      ) -> tuple[Batch, PromptBatch]:
        """Rollout of the GLOBAL `prompts` (global indices from `first_index`) over every engine: this DP rank's
        rows as the workers' batch, and each row's prompt. Every rank has every response, so each builds its
        rows itself."""
        prompt_ids = offpolicy.prompt_ids(prompts.input_ids, prompts.attention_mask)
        responses = self.rollout.generate(prompt_ids, sampling, step=self.step, first_index=first_index,
                                          agent=self.agent)
        mine, offset = self.io.dp_slice(prompts)
        n = sampling.n
        batch = build_rollout_batch(mine, responses[offset * n:(offset + len(mine)) * n], n=n,
                                    max_response_length=self.cfg.data.max_response_length,
                                    pad_token_id=self.data.tokenizer.pad_token_id)
        return batch, mine.repeat(n)

    def reward(self, batch: Batch, rows: PromptBatch, extra_key: str | None = None) -> None:
        """`token_level_scores` of the batch's responses (`rows`: each row's prompt) and `reward_errors` (the
        scorer's failures), scored on the model-parallel leader and shared with its group; with `extra_key`, also
        that key of the reward extra info as FILTER_METRIC (NaN where the function did not return it)."""
        scored = None
        if self.io.is_leader:
            scores, reward_metrics, extra = self.data.reward.score_with_info(
                rows.raw_prompts, batch["responses"], batch["response_mask"], rows.data_sources, rows.ground_truths,
                rows.extra_infos)
            tensors = {"token_level_scores": scores,
                       "reward_errors": torch.tensor([reward_metrics.get("reward/errors", 0.0)])}
            if extra_key is not None:
                tensors[FILTER_METRIC] = extra.get(extra_key, torch.full((scores.shape[0],), float("nan")))
            scored = (tensors, self.data.reward.last_error)
        tensors, self.reward_last_error = self.io.broadcast_from_leader(scored)
        batch.update(tensors)

    def train_reward(self, batch: Batch, rows: PromptBatch, prompts: PromptBatch, first_index: int) -> None:
        """The reward of a training rollout of the GLOBAL `prompts`: scores, shaped (DAPO's overlong penalty), and
        ReMax's greedy baselines when the estimator needs them."""
        self.reward(batch, rows, reward_extra_key(self.cfg))
        response_shaping.shape_scores(self.cfg, batch)
        for provide in self.reward_inputs:  # what the estimator needs of each generation batch (mppo.trainer.
            provide(batch, prompts, first_index)  # estimator_inputs: ReMax's greedy baselines)

    def generation_batch(self, prompts: PromptBatch, first_index: int) -> Batch:
        """A further generation batch of dynamic sampling: rolled out and rewarded, as the step's first."""
        batch, rows = self.rollout_batch(prompts, first_index, self.train_sampling)
        self.train_reward(batch, rows, prompts, first_index)
        return batch

    def rollout_mismatch_metrics(self, batch: Batch) -> dict[str, float]:
        """The engine's log-probs against the actor's old ones (and, under partial rollouts, per weight version)."""
        metrics = rollout_correction.mismatch_metrics(batch, self.io.dp_group)
        if "rollout_token_versions" in batch:
            keys = ("rollout_log_probs", "old_log_probs", "response_mask", "rollout_token_versions")
            metrics.update(offpolicy.partial_rollout_metrics(self.gather_global(batch, keys), self.step))
        return metrics

    def compute_old_log_probs(self, batch: Batch, temperature: float) -> None:
        """`old_log_probs` (and `sum_pi_squared` when the estimator needs it) from the actor before its update."""
        outs = self.actor.compute_log_prob_outputs(
            batch, temperature=temperature, micro_batch_size=old_log_prob_micro_batch(self.cfg),
            calculate_sum_pi_squared=bool(self.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared))
        batch["old_log_probs"] = outs["log_probs"]
        if "sum_pi_squared" in outs:
            batch["sum_pi_squared"] = outs["sum_pi_squared"]

    def gather_global(self, batch: Batch, keys: tuple[str, ...]) -> Batch:
        """The global batch's `keys` (those the batch has), gathered over DP, on the CPU whatever device the
        workers computed on: these are [B, T] bookkeeping tensors."""
        return rollout_correction.gather_global(batch, tuple(k for k in keys if k in batch), self.io.dp_group)

    def kl_penalty(self, batch: Batch) -> dict[str, float]:
        """`token_level_rewards`: the scores less the KL penalty to the reference when algorithm.use_kl_in_reward
        (the KL controller sees the whole global batch), else the scores."""
        if not self.cfg.algorithm.use_kl_in_reward:
            batch["token_level_rewards"] = batch["token_level_scores"]
            return {}
        full = self.gather_global(batch, _KL_INPUTS)
        rewards, metrics = core_algos.apply_kl_penalty(
            full["token_level_scores"], full["old_log_probs"], full["ref_log_prob"], full["response_mask"],
            self.kl_ctrl, kl_penalty=self.cfg.algorithm.kl_penalty)
        batch["token_level_rewards"] = local_rows(rewards, self.io.dp_group)
        return metrics

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        """Advantages and returns on the whole global batch (gathered over DP), after rollout correction's IS
        weights and rejection and the masking of truncated responses; this rank's rows back into `batch`."""
        cfg = self.cfg.algorithm
        full = self.gather_global(batch, _ADV_INPUTS)
        metrics, corrected = self.rollout_corr.before_advantages(full)
        sampling = self.train_sampling
        trunc_metrics, masked = response_shaping.mask_truncated(
            self.cfg, full, () if sampling.ignore_eos else sampling.stop_token_ids)
        metrics.update(trunc_metrics)
        full["advantages"], full["returns"] = core_algos.compute_advantage(
            cfg.adv_estimator, token_level_rewards=full["token_level_rewards"], response_mask=full["response_mask"],
            values=full.get("values"), index=full["uid"].numpy().astype(object), gamma=cfg.gamma, lam=cfg.lam,
            norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo, old_log_probs=full.get("old_log_probs"),
            reward_baselines=full.get("reward_baselines"), sum_pi_squared=full.get("sum_pi_squared"),
            rollout_is_weights=full.get("rollout_is_weights"))
        # the response lengths as generated (UNREJECTED_MASK) go along for the step's metrics
        for key in dict.fromkeys(("advantages", "returns", *corrected, *masked, UNREJECTED_MASK)):
            if key in full:
                batch[key] = local_rows(full[key], self.io.dp_group)
        return metrics

    def _step_metrics(self, data: Batch, batch: Batch, timer: StepTimer) -> dict[str, float]:
        """veRL's data, timing and throughput metrics of the step; `data`: the global batch's _METRIC_INPUTS."""
        metrics = compute_data_metrics(data, max_response_length=self.cfg.data.max_response_length,
                                       max_prompt_length=self.cfg.data.max_prompt_length)
        metrics.update(timer.metrics())
        metrics.update(response_shaping.overlong_metrics(self.cfg, data))
        metrics.update(tool_call_metrics(data))
        # the tokens the policy generated (before rollout-correction rejection) are what each pass computes on
        response_tokens = int(data.get(UNREJECTED_MASK, data["response_mask"]).sum().item())
        num_tokens = int(data["prompt_mask"].sum().item()) + response_tokens
        # the last step's count, read by `mppo bench step`
        self.step_flops = ppo_step_flops(self.actor.hf_args, prompt_tokens=num_tokens - response_tokens,
                                         response_tokens=response_tokens, use_critic=self.critic is not None,
                                         use_ref=self.ref is not None,
                                         old_log_prob_pass=self.old_log_prob_source is OldLogProbSource.ACTOR_PASS)
        metrics.update(perf_metrics(num_tokens=num_tokens, step_seconds=timer.seconds["step"],
                                    world_size=self.dims.world + engine_world(self.cfg), flops=self.step_flops,
                                    device=self.device))
        errors = all_gather_rows(batch["reward_errors"], self.io.dp_group)
        metrics["reward/errors"] = float(errors.sum().item())
        # the scorer sees only responses with a token to put the score on (mppo.rewards.manager)
        scored = int((data.get(UNREJECTED_MASK, data["response_mask"]).sum(-1) > 0).sum().item())
        metrics["reward/error_fraction"] = metrics["reward/errors"] / max(scored, 1)
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
        # the off-policy pipeline's next k steps' prompts, taken k steps early, each with the loader's state before
        # it was taken (a checkpoint after this step resumes with the first of them)
        upcoming: collections.deque[tuple[dict, PromptBatch]] = collections.deque()
        while self.step < self.total_steps:
            prompts = upcoming.popleft()[1] if upcoming else next(batches)
            while len(upcoming) < min(self.off_policy_steps, self.total_steps - self.step - 1):
                upcoming.append((loader.state_dict(), next(batches)))
            loader_state = upcoming[0][0] if upcoming else loader.state_dict()
            metrics = self.train_step(prompts, more_prompts=lambda: next(batches),
                                      next_prompts=[batch for _, batch in upcoming])
            self.step += 1
            self._count_skips(metrics)
            metrics["training/epoch"] = loader.epoch
            last = self.step >= self.total_steps
            if self.data.val_dataset is not None and cfg.test_freq > 0 and (
                    self.step % cfg.test_freq == 0 or last):
                metrics.update(self.validate())
            self.metrics.log(self.step, metrics)
            self._stop_if_diverging()
            self._stop_if_rewards_fail(metrics)
            bar.update(1)
            bar.set_postfix({k.split("/", 1)[-1]: f"{metrics[k]:.3g}" for k in
                             ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "response_length/mean")
                             if k in metrics}, refresh=False)
            if (cfg.save_freq > 0 and self.step % cfg.save_freq == 0) or last:
                self.save_checkpoint(loader_state if upcoming else None)
        bar.close()
        if self._owns_rollout:
            self.rollout.shutdown()
        self.watchdog.close()
        self.metrics.close()
        if self.is_main and self.metrics.path.exists():
            png = plot_metrics(self.metrics.path, self.run_dir / "metrics.png")
            log.info("done: %d steps; metrics in %s, plot in %s", self.step, self.metrics.path, png)

    def validate(self) -> dict[str, float]:
        """Mean score per data source of the validation set (`val/test_score/<source>`, the same on every rank) and
        the seconds it took (weight sync, generation and scoring: `timing_s/testing`)."""
        began = time.perf_counter()
        with self.watchdog.phase("validate", self.step):
            self.sync_weights()
            metrics = validation.mean_scores(self.data.val_dataset, self.validation_scores,
                                             batch_size=self.cfg.data.val_batch_size,
                                             pad_token_id=self.data.tokenizer.pad_token_id, dp=self.dims.dp,
                                             dp_group=self.io.dp_group)
            self.rollout.release()
        metrics["timing_s/testing"] = time.perf_counter() - began
        return metrics

    def validation_scores(self, prompts: PromptBatch, first_index: int) -> tuple[torch.Tensor, list[str]]:
        """The summed scores of this DP rank's validation responses to the GLOBAL `prompts`, and their sources."""
        batch, rows = self.rollout_batch(prompts, first_index, self.val_sampling)
        self.reward(batch, rows)
        return batch["token_level_scores"].sum(-1), rows.data_sources

    def _count_skips(self, metrics: dict[str, float]) -> None:
        """Count steps whose update was skipped for a NaN/inf loss or grad norm (`training/skipped_steps`)."""
        skipped = bool(metrics.get("actor/skipped", 0.0)) or bool(metrics.get("critic/skipped", 0.0))
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        self.skipped_steps += int(skipped)
        metrics["training/skipped_steps"] = self.skipped_steps
        if skipped:
            log.warning("step %d: non-finite loss or grad norm, update skipped (%d in a row)", self.step,
                        self.consecutive_skips)

    def _stop_if_rewards_fail(self, metrics: dict[str, float]) -> None:
        """reward.max_failed_steps: stop once every response of that many steps in a row failed to score (the
        metrics are global, so every rank takes the same decision), naming the function and its last error."""
        all_failed = metrics["reward/errors"] > 0 and metrics["reward/error_fraction"] >= 1.0
        self.consecutive_failed_rewards = self.consecutive_failed_rewards + 1 if all_failed else 0
        limit = self.cfg.reward.max_failed_steps
        if limit and self.consecutive_failed_rewards >= limit:
            name = reward_function_name(self.data.reward.compute_score)
            raise RewardFunctionFailedError(
                f"stopped at step {self.step}: the reward function {name} "
                f"failed on every response of {self.consecutive_failed_rewards} steps in a row "
                f"(reward.max_failed_steps={limit}); its last error: {self.reward_last_error or 'unknown'}. Fix the "
                f"reward function (the first traceback is in the log; reward.custom_fn.path selects it) and resume "
                f"from the last checkpoint in {self.ckpt.root}")

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


def _update_metrics(role: str, worker_metrics: dict[str, float]) -> dict[str, float]:
    """A worker update's metrics (global: identical on every rank); `<role>/skipped` marks a non-finite update."""
    skipped = float(worker_metrics.pop("skipped", False))
    return {f"{role}/skipped": skipped, **worker_metrics}


def _total_steps(cfg: MppoConfig, batches_per_epoch: int) -> int:
    return cfg.trainer.total_training_steps or cfg.trainer.total_epochs * batches_per_epoch


def run(cfg: MppoConfig) -> int:
    side = offpolicy.start_side(cfg)  # hybrid_engine=false: trainer and engine ranks apart
    if side is not None and side.role == ENGINE:
        return offpolicy.run_engine_side(cfg, side)
    trainer = PPOTrainer(cfg, side=side)
    trainer.fit()
    return 0
