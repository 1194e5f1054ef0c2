"""torchrun script (4 CPU ranks, gloo): actor / critic / reference workers against plain-torch references.

One launch runs every case and writes out/rank{R}.json: {case name: number, bool or string}; the pytest side
(tests/test_workers_parallel.py) asserts on them. References: HF transformers forward, core_algos losses on HF
log-probs, torch.optim.AdamW (tests/dist/workers_fixtures.py), and runs of the workers at other layouts.
"""
from __future__ import annotations

import gc
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import load_hf_model, make_hf_model  # noqa: E402
from workers_overlap import overlap_cases  # noqa: E402
from workers_lora import lora_cases  # noqa: E402
from workers_fixtures import (TEMPERATURE, add_value_head, count_host_reads, dp_shard,  # noqa: E402
                              hf_response_logprobs, hf_values, make_batch, max_state_diff, mean_steps,
                              reference_actor_updates, reference_critic_updates)

# (tp, pp, vpp, logprob_impl, use_dynamic_bsz, cp): every layout of 4 ranks, both log-prob paths, both batchings;
# context parallelism alone (DP2, token-budget micro-batches), with TP2 + SP and with PP2
ACTOR_LAYOUTS = [(2, 2, None, "fused", False, 1), (1, 1, None, "naive", False, 1), (2, 1, None, "fused", True, 1),
                 (1, 2, None, "naive", True, 1), (1, 2, 2, "fused", False, 1), (1, 1, None, "fused", True, 2),
                 (2, 1, None, "fused", False, 2), (1, 2, None, "naive", False, 2)]
MINI = 4  # global mini-batch (rows); the 8-row batch makes two optimizer steps
OPTIM = dict(lr=1e-2, eps=1e-3, clip_grad=1.0)
LOSS = dict(clip_low=0.2, clip_high=0.28, entropy_coeff=0.01, kl_coef=0.1, kl_type="low_var_kl")
CLIPRANGE_VALUE = 0.2
# (loss_agg_mode, policy loss_mode): a token mode, a sequence mode, and a loss that ignores GlobalBatchInfo
NORMALISATION_CASES = (("token-mean", "vanilla"), ("seq-mean-token-mean", "vanilla"), ("token-mean", "geo_mean"))


def name(tp, pp, vpp, cp=1) -> str:
    return f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "") + (f"cp{cp}" if cp > 1 else "")


def actor_config(tp, pp, vpp, *, impl="fused", dynamic=False, mode="token-mean", dist_opt=True, micro=1, mini=MINI,
                 cp=1):
    from mppo.config.schema import ActorConfig, MegatronConfig, OptimConfig

    cfg = ActorConfig(ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic,
                      ppo_max_token_len_per_gpu=30, clip_ratio_low=LOSS["clip_low"],
                      clip_ratio_high=LOSS["clip_high"], loss_agg_mode=mode, entropy_coeff=LOSS["entropy_coeff"],
                      use_kl_loss=True, kl_loss_coef=LOSS["kl_coef"], kl_loss_type=LOSS["kl_type"],
                      logprob_impl=impl, kernel_backend="torch")
    cfg.optim = OptimConfig(lr=OPTIM["lr"], eps=OPTIM["eps"], clip_grad=OPTIM["clip_grad"], weight_decay=0.0)
    cfg.megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  virtual_pipeline_model_parallel_size=vpp, use_distributed_optimizer=dist_opt,
                                  recompute="none", seed=0, context_parallel_size=cp)
    return cfg


def exported(worker) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in worker.export_hf_weights(1 << 16) for n, t in bucket}


def metric_diffs(got: dict, ref: dict, keys) -> float:
    return max(abs(got[k] - ref[k]) for k in keys)


class Cases:
    def __init__(self, work: Path, res: dict, rank: int):
        self.work, self.res, self.rank = work, res, rank

    def setup(self) -> None:
        from mppo.models.hf_config import read_hf_config

        if self.rank == 0:
            make_hf_model("qwen2_untied", self.work / "actor", seed=0)
            make_hf_model("qwen2_tied", self.work / "tied", seed=1)
            make_hf_model("qwen2_untied", self.work / "lora_other_base", seed=5)  # LoRA: another base
            add_value_head(self.work / "actor", self.work / "critic")
        dist.barrier()
        self.vocab = read_hf_config(self.work / "actor").vocab_size
        batch = make_batch(self.vocab, seed=0)
        hf = load_hf_model(self.work / "actor")
        with torch.no_grad():
            self.hf_lp, self.hf_ent = hf_response_logprobs(hf, batch)
        g = torch.Generator().manual_seed(11)
        # old / ref log-probs near the current ones, so ratios clip on some tokens and the KL is not 0
        mask = batch["response_mask"]
        batch["old_log_probs"] = (self.hf_lp + 0.3 * torch.randn(self.hf_lp.shape, generator=g)) * mask
        batch["ref_log_prob"] = (self.hf_lp + 0.2 * torch.randn(self.hf_lp.shape, generator=g)) * mask
        self.batch = batch
        self.refs = {}
        for mode, loss_mode in NORMALISATION_CASES:
            self.refs[mode, loss_mode] = reference_actor_updates(
                load_hf_model(self.work / "actor"), batch, mini_batch_size=MINI, loss_agg_mode=mode,
                loss_mode=loss_mode, **OPTIM, **LOSS)
        self.res["ref/max_weight_change"] = max_state_diff(self.refs["token-mean", "vanilla"][0], hf.state_dict())
        self.res["ref/clipfrac"] = mean_steps(self.refs["token-mean", "vanilla"][1])["actor/pg_clipfrac"]

    # ---------------------------------------------------------------------------------------- actor
    def actor_layouts(self) -> None:
        from mppo.config.schema import ModelConfig, RefConfig
        from mppo.models.builders import unwrap_model
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.actor import ActorWorker
        from mppo.workers.reference import ReferenceWorker

        ref_state, ref_steps = self.refs["token-mean", "vanilla"]
        ref_metrics = mean_steps(ref_steps)
        for tp, pp, vpp, impl, dynamic, cp in ACTOR_LAYOUTS:
            key = name(tp, pp, vpp, cp)
            dims = init_distributed(tp, pp, vpp, cp=cp, seed=1234)
            shard = dp_shard(self.batch, dims.dp, dims.dp_rank)
            hf_lp = self.hf_lp[dims.dp_rank::dims.dp]
            actor = ActorWorker(ModelConfig(), actor_config(tp, pp, vpp, impl=impl, dynamic=dynamic, cp=cp), dims,
                                self.work / "actor", total_steps=4)
            outs = actor.compute_log_prob_outputs(shard, temperature=TEMPERATURE, calculate_entropy=True)
            lp, ent = outs["log_probs"], outs["entropy"]
            self.res[f"{key}/sequence_parallel"] = unwrap_model(actor.model[0]).config.sequence_parallel
            self.res[f"{key}/log_probs_vs_hf"] = (lp - hf_lp).abs().max().item()
            self.res[f"{key}/entropy_vs_hf"] = (ent - self.hf_ent[dims.dp_rank::dims.dp]).abs().max().item()
            if cp > 1:
                # token-budget and count micro-batches under CP; the whole batch on every rank vs the CP1 run's
                by_tokens = actor.compute_log_prob(shard, temperature=TEMPERATURE, max_token_len=26)
                self.res[f"{key}/token_budget_vs_count"] = (by_tokens - lp).abs().max().item()
                full = actor.compute_log_prob_outputs(self.batch, temperature=TEMPERATURE, calculate_entropy=True,
                                                      micro_batch_size=3)
                self.res[f"{key}/log_probs_vs_cp1"] = (full["log_probs"] - cp1[0]).abs().max().item()
                self.res[f"{key}/entropy_vs_cp1"] = (full["entropy"] - cp1[1]).abs().max().item()
            if key == "tp1pp1":
                full = actor.compute_log_prob_outputs(self.batch, temperature=TEMPERATURE, calculate_entropy=True,
                                                      micro_batch_size=3)
                cp1 = (full["log_probs"], full["entropy"])
            if key == "tp2pp2":
                by_tokens = actor.compute_log_prob(shard, temperature=TEMPERATURE, max_token_len=26)
                self.res[f"{key}/token_budget_vs_count"] = (by_tokens - lp).abs().max().item()
                naive = ActorWorker(ModelConfig(), actor_config(tp, pp, vpp, impl="naive"), dims,
                                    self.work / "actor", total_steps=4)
                nlp = naive.compute_log_prob(shard, temperature=TEMPERATURE, micro_batch_size=3)
                self.res[f"{key}/naive_vs_fused"] = (nlp - lp).abs().max().item()
                no_sp = actor_config(tp, pp, vpp)
                no_sp.megatron.sequence_parallel = False
                plain = ActorWorker(ModelConfig(), no_sp, dims, self.work / "actor", total_steps=4)
                self.res[f"{key}/plain_tp_sequence_parallel"] = unwrap_model(plain.model[0]).config.sequence_parallel
                self.res[f"{key}/plain_tp_vs_sp"] = (plain.compute_log_prob(shard, temperature=TEMPERATURE)
                                                     - lp).abs().max().item()
                ref = ReferenceWorker(ModelConfig(), RefConfig(log_prob_micro_batch_size_per_gpu=2), dims,
                                      self.work / "actor", logprob_impl="fused", kernel_backend="torch")
                rlp = ref.compute_log_prob(shard, temperature=TEMPERATURE)
                self.res[f"{key}/ref_vs_actor"] = (rlp - lp).abs().max().item()
                self.res[f"{key}/ref_frozen"] = all(not p.requires_grad for c in ref.model for p in c.parameters())
            metrics = actor.update(shard, temperature=TEMPERATURE)
            weights = exported(actor)
            self.res[f"{key}/weights_vs_hf_adamw"] = max_state_diff(weights, ref_state)
            if key == "tp2pp2":
                first = weights
            self.res[f"{key}/weights_vs_tp2pp2"] = max_state_diff(weights, first)
            self.res[f"{key}/metrics_vs_ref"] = metric_diffs(
                metrics, ref_metrics, ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac",
                                       "actor/ppo_kl", "actor/pg_clipfrac_lower"))
            self.res[f"{key}/grad_norm_rel"] = abs(metrics["actor/grad_norm"] / ref_metrics["actor/grad_norm"] - 1)
            self.res[f"{key}/metrics"] = {k: v for k, v in metrics.items()}
            destroy()

    def global_normalisation(self) -> None:
        """DP1 with each mini-batch in ONE micro-batch (TP2xPP2) and DP2 with two micro-batches per rank
        (TP2xPP1) give the same update, equal to the plain-torch one: a token mode, a sequence mode, and
        geo_mean (a loss that averages over rows and ignores the global batch facts)."""
        from mppo.config.schema import ModelConfig
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.actor import ActorWorker

        for mode, loss_mode in NORMALISATION_CASES:
            ref_state, ref_steps = self.refs[mode, loss_mode]
            case = f"{mode}/{loss_mode}"
            weights = {}
            for tp, pp, micro in ((2, 2, MINI), (2, 1, 1)):
                key = f"{case}/{name(tp, pp, None)}"
                dims = init_distributed(tp, pp, seed=1234)
                cfg = actor_config(tp, pp, None, mode=mode, micro=micro)
                cfg.policy_loss.loss_mode = loss_mode
                actor = ActorWorker(ModelConfig(), cfg, dims, self.work / "actor", total_steps=4)
                metrics = actor.update(dp_shard(self.batch, dims.dp, dims.dp_rank), temperature=TEMPERATURE)
                weights[key] = exported(actor)
                self.res[f"{key}/weights_vs_hf_adamw"] = max_state_diff(weights[key], ref_state)
                self.res[f"{key}/grad_norm_rel"] = abs(
                    metrics["actor/grad_norm"] / mean_steps(ref_steps)["actor/grad_norm"] - 1)
                self.res[f"{key}/pg_loss_diff"] = abs(
                    metrics["actor/pg_loss"] - mean_steps(ref_steps)["actor/pg_loss"])
                destroy()
            self.res[f"{case}/dp2_vs_dp1"] = max_state_diff(weights[f"{case}/tp2pp1"], weights[f"{case}/tp2pp2"])

    def tied_embeddings(self) -> None:
        """Tied input/output embeddings across pipeline stages (their grads are summed over PP): TP2xPP2."""
        from mppo.config.schema import ModelConfig
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.actor import ActorWorker

        hf = load_hf_model(self.work / "tied")
        batch = make_batch(hf.config.vocab_size, seed=5)
        with torch.no_grad():
            lp, _ = hf_response_logprobs(hf, batch)
        batch["old_log_probs"] = lp + 0.1 * batch["advantages"].flip(0) * batch["response_mask"]
        batch["ref_log_prob"] = lp
        state, steps = reference_actor_updates(hf, batch, mini_batch_size=MINI, loss_agg_mode="token-mean",
                                               **OPTIM, **LOSS)
        state.pop("lm_head.weight")  # the same tensor as the embedding
        dims = init_distributed(2, 2, seed=1234)
        actor = ActorWorker(ModelConfig(), actor_config(2, 2, None), dims, self.work / "tied", total_steps=4)
        metrics = actor.update(batch, temperature=TEMPERATURE)
        self.res["tied/weights_vs_hf_adamw"] = max_state_diff(exported(actor), state)
        self.res["tied/grad_norm_rel"] = abs(metrics["actor/grad_norm"] / mean_steps(steps)["actor/grad_norm"] - 1)
        destroy()

    def nan_skip(self) -> None:
        """Faults on ONE rank skip the step on every rank and leave weights and Adam state unchanged (one
        mini-batch: the whole batch): a NaN advantage (non-finite loss), then an inf gradient (a hook)."""
        from mppo.config.schema import ModelConfig
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.actor import ActorWorker

        dims = init_distributed(1, 2, seed=1234)
        actor = ActorWorker(ModelConfig(), actor_config(1, 2, None, mini=8), dims, self.work / "actor",
                            total_steps=4)
        inner = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]

        def adam_steps():
            return sorted({float(s["step"]) for o in inner for s in o.state.values()})

        clean = dp_shard(self.batch, dims.dp, dims.dp_rank)
        shard = dp_shard(self.batch, dims.dp, dims.dp_rank)
        before = exported(actor)
        if dims.dp_rank == 1:
            shard["advantages"][0, 0] = float("nan")  # row 1 of the batch: a valid response token
        metrics = actor.update(shard, temperature=TEMPERATURE)
        self.res["nan/skipped"] = metrics["skipped"]
        self.res["nan/skipped_steps"] = metrics["actor/skipped_optimizer_steps"]
        self.res["nan/weights_unchanged"] = all(torch.equal(before[k], t) for k, t in exported(actor).items())
        self.res["nan/adam_untouched"] = adam_steps() == []
        self.res["nan/clean_update_not_skipped"] = not actor.update(clean, temperature=TEMPERATURE)["skipped"]

        before, steps = exported(actor), adam_steps()
        hook = None
        if dims.rank == 0:  # an inf in one gradient of one rank; the loss stays finite
            param = next(p for p in actor.model[0].parameters() if p.requires_grad)
            hook = param.register_hook(lambda g: g * float("inf"))
        metrics = actor.update(clean, temperature=TEMPERATURE)
        if hook is not None:
            hook.remove()
        self.res["inf_grad/skipped"] = metrics["skipped"]
        self.res["inf_grad/loss_finite"] = bool(torch.isfinite(torch.tensor(metrics["actor/pg_loss"])))
        self.res["inf_grad/weights_unchanged"] = all(torch.equal(before[k], t) for k, t in exported(actor).items())
        self.res["inf_grad/adam_steps_unchanged"] = adam_steps() == steps == [1.0]
        destroy()

    # ---------------------------------------------------------------------------------------- bf16
    def bf16_training(self) -> None:
        """bf16 parameters with fp32 main params in megatron's distributed optimizer (TP2 x DP2) against the fp32
        run from the same weights: log-probs, one optimizer step's metrics and weight change; the naive log-prob
        path equal to the fused one on the bf16 weights (both take the logits in fp32); and updates far below
        bf16's resolution that still move the weights after some steps (they accumulate in the fp32 main params;
        a bf16-only optimizer would round every one of them away)."""
        from mppo.config.schema import ModelConfig
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.actor import ActorWorker

        dims = init_distributed(2, 1, seed=1234)
        shard = dp_shard(self.batch, dims.dp, dims.dp_rank)
        runs = {}
        for dtype in ("fp32", "bf16"):
            actor = ActorWorker(ModelConfig(dtype=dtype), actor_config(2, 1, None, mini=8), dims,
                                self.work / "actor", total_steps=4)
            before = exported(actor)
            lp = actor.compute_log_prob(shard, temperature=TEMPERATURE)
            metrics = actor.update(shard, temperature=TEMPERATURE)  # one mini-batch: one optimizer step
            after = exported(actor)
            runs[dtype] = {"lp": lp, "metrics": metrics, "delta": {k: after[k].float() - before[k].float()
                                                                    for k in after}}
            if dtype == "bf16":
                self.res["bf16/param_dtypes"] = sorted({str(p.dtype) for c in actor.model for p in c.parameters()})
                self.res["bf16/export_dtypes"] = sorted({str(t.dtype) for t in before.values()})
                naive = ActorWorker(ModelConfig(dtype=dtype), actor_config(2, 1, None, impl="naive", mini=8), dims,
                                    self.work / "actor", total_steps=4)
                fused_lp = ActorWorker(ModelConfig(dtype=dtype), actor_config(2, 1, None, mini=8), dims,
                                       self.work / "actor", total_steps=4).compute_log_prob(
                                           shard, temperature=TEMPERATURE)
                naive_lp = naive.compute_log_prob(shard, temperature=TEMPERATURE)
                self.res["bf16/naive_vs_fused_log_probs"] = (naive_lp - fused_lp).abs().max().item()
        f32, b16 = runs["fp32"], runs["bf16"]
        self.res["bf16/log_probs_vs_fp32"] = (b16["lp"] - f32["lp"]).abs().max().item()
        self.res["bf16/fp32_log_probs_vs_hf"] = (f32["lp"] - self.hf_lp[dims.dp_rank::dims.dp]).abs().max().item()
        self.res["bf16/metrics_rel"] = {k: abs(b16["metrics"][k] / f32["metrics"][k] - 1)
                                        for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy",
                                                  "actor/grad_norm")}
        num = sum(((b16["delta"][k] - f32["delta"][k]) ** 2).sum() for k in f32["delta"])
        den = sum((f32["delta"][k] ** 2).sum() for k in f32["delta"])
        self.res["bf16/weight_change_rel"] = float((num / den) ** 0.5)

        # lr 1e-5: an Adam step moves a weight by about 1e-5 (at most ~3.2e-5), under half a bf16 step (>= 6.1e-5)
        # for every |w| >= 2^-6, so no such weight can change unless the updates accumulate in fp32
        cfg = actor_config(2, 1, None, mini=8)
        cfg.optim.lr = 1e-5
        actor = ActorWorker(ModelConfig(dtype="bf16"), cfg, dims, self.work / "actor", total_steps=40)
        start = exported(actor)
        large = {k: t.float().abs() >= 2 ** -6 for k, t in start.items()}
        changed = []
        for step in range(20):
            actor.update(shard, temperature=TEMPERATURE)
            if step in (0, 19):
                now = exported(actor)
                moved = sum(int(((now[k] != start[k]) & large[k]).sum()) for k in start)
                changed.append(moved / sum(int(m.sum()) for m in large.values()))
        self.res["bf16/small_updates_changed_after_1_and_20_steps"] = changed
        destroy()

    # ---------------------------------------------------------------------------------------- critic
    def critic(self) -> None:
        from mppo.config.schema import CriticConfig, MegatronConfig, ModelConfig, OptimConfig
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.critic import CriticWorker

        from safetensors.torch import load_file

        hf = load_hf_model(self.work / "actor")  # the critic's trunk; its head comes from the critic checkpoint
        head = torch.nn.Linear(hf.config.hidden_size, 1)
        score = load_file(str(self.work / "critic" / "model.safetensors"))
        with torch.no_grad():
            head.weight.copy_(score["score.weight"])
            head.bias.copy_(score["score.bias"])
            values_before = hf_values(hf, head, self.batch) * self.batch["response_mask"]
        ref_state, ref_steps = reference_critic_updates(hf, head, self.batch, mini_batch_size=MINI, lr=OPTIM["lr"],
                                                        eps=OPTIM["eps"], clip_grad=OPTIM["clip_grad"],
                                                        loss_agg_mode="token-mean", cliprange_value=CLIPRANGE_VALUE,
                                                        epochs=2)
        ref_metrics = mean_steps(ref_steps)
        for tp, pp, cp in ((2, 2, 1), (1, 1, 1), (1, 1, 2)):
            key = f"critic/{name(tp, pp, None, cp)}"
            dims = init_distributed(tp, pp, cp=cp, seed=1234)
            cfg = CriticConfig(ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False,
                               ppo_epochs=2, cliprange_value=CLIPRANGE_VALUE, loss_agg_mode="token-mean",
                               optim=OptimConfig(lr=OPTIM["lr"], eps=OPTIM["eps"], clip_grad=OPTIM["clip_grad"],
                                                 weight_decay=0.0),
                               megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                       use_distributed_optimizer=tp == 2, seed=0,
                                                       context_parallel_size=cp))
            critic = CriticWorker(ModelConfig(), cfg, dims, self.work / "critic", total_steps=4)
            shard = dp_shard(self.batch, dims.dp, dims.dp_rank)
            values = critic.compute_values(shard)
            self.res[f"{key}/values_vs_hf"] = (values - values_before[dims.dp_rank::dims.dp]).abs().max().item()
            self.res[f"{key}/head_dtype"] = str(critic.model[-1].module.output_layer.weight.dtype) \
                if dims.is_last_stage else "torch.float32"
            metrics = critic.update(shard)
            self.res[f"{key}/weights_vs_hf_adamw"] = max_state_diff(exported(critic), ref_state)
            self.res[f"{key}/metrics_vs_ref"] = metric_diffs(metrics, ref_metrics, ("critic/vf_loss",
                                                                                    "critic/vf_clipfrac"))
            self.res[f"{key}/grad_norm_rel"] = abs(metrics["critic/grad_norm"] / ref_metrics["critic/grad_norm"] - 1)
            self.res[f"{key}/values_after"] = critic.compute_values(self.batch).tolist()
            destroy()

    def host_reads(self) -> None:
        """Tensor -> host reads (device syncs on a GPU) inside each micro-batch's loss function of an update: the
        metrics accumulate on the device and are read once per optimizer step (StepMetrics.reduce)."""
        from mppo.config.schema import CriticConfig, MegatronConfig, ModelConfig, OptimConfig
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.actor import ActorWorker
        from mppo.workers.critic import CriticWorker

        def counting(make_loss_fn, reads: list[int]):
            def make(*args, **kwargs):
                loss_fn = make_loss_fn(*args, **kwargs)

                def counted(output):
                    counts: dict[str, int] = {}
                    with count_host_reads(counts):
                        result = loss_fn(output)
                    reads.append(sum(counts.values()))
                    return result
                return counted
            return make

        dims = init_distributed(1, 1, seed=1234)
        shard = dp_shard(self.batch, dims.dp, dims.dp_rank)
        for impl in ("fused", "naive"):
            actor = ActorWorker(ModelConfig(), actor_config(1, 1, None, impl=impl), dims, self.work / "actor",
                                total_steps=4)
            reads: list[int] = []
            actor._loss_fn = counting(actor._loss_fn, reads)
            actor.update(shard, temperature=TEMPERATURE)
            self.res[f"host_reads/actor_{impl}"] = reads
        cfg = CriticConfig(ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False,
                           ppo_epochs=1, cliprange_value=CLIPRANGE_VALUE, loss_agg_mode="token-mean",
                           optim=OptimConfig(lr=OPTIM["lr"], eps=OPTIM["eps"], clip_grad=OPTIM["clip_grad"]),
                           megatron=MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                   seed=0))
        critic = CriticWorker(ModelConfig(), cfg, dims, self.work / "critic", total_steps=4)
        reads = []
        critic._loss_fn = counting(critic._loss_fn, reads)
        critic.update(shard)
        self.res["host_reads/critic"] = reads
        destroy()

    # ---------------------------------------------------------------------------------------- checkpoints
    def checkpoints(self) -> None:
        from mppo.config.schema import ModelConfig
        from mppo.parallel import destroy, init_distributed
        from mppo.workers.actor import ActorWorker
        from mppo.workers.worker_checkpoint import (CheckpointMismatchError, load_worker_checkpoint,
                                                    save_worker_checkpoint)

        def rng_draw():
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                tracked = torch.rand(2).tolist()
            return [torch.rand(2).tolist(), random.random(), float(np.random.rand()), tracked]

        def errors(fn) -> str:
            try:
                fn()
                return "no error"
            except (CheckpointMismatchError, FileNotFoundError) as err:
                return f"{type(err).__name__}: {err}"

        full = self.batch
        ckpts = {}
        # Uninterrupted runs at TP2xPP2: distributed (dp_reshardable) and plain optimizer, fp32 and bf16 params
        # (bf16: the fp32 main params must come back from the checkpoint, not from the rounded bf16 weights).
        for dist_opt, dtype in ((True, "fp32"), (False, "fp32"), (True, "bf16"), (False, "bf16")):
            name = ("dist" if dist_opt else "plain") + ("" if dtype == "fp32" else "_bf16")
            dims = init_distributed(2, 2, seed=1234)
            actor = ActorWorker(ModelConfig(dtype=dtype), actor_config(2, 2, None, dist_opt=dist_opt), dims,
                                self.work / "actor", total_steps=4)
            actor.update(full, temperature=TEMPERATURE)
            path = self.work / f"ckpt_{name}"
            save_worker_checkpoint(actor, path, extra_state={"step": 1, "data": [3, 4]})
            saved_weights = exported(actor)
            draw = rng_draw()
            lp1 = actor.compute_log_prob(full, temperature=TEMPERATURE)
            m2 = actor.update(full, temperature=TEMPERATURE)
            if dtype == "fp32":
                ckpts[dist_opt] = (path, exported(actor), m2, saved_weights, lp1)
            after_step2 = exported(actor)
            # resume in fresh models at the same layout: step 2 must be bit-identical
            torch.manual_seed(999)
            random.seed(999)
            again = ActorWorker(ModelConfig(dtype=dtype), actor_config(2, 2, None, dist_opt=dist_opt), dims,
                                self.work / "actor", total_steps=4)
            loaded = load_worker_checkpoint(again, path)
            tag = f"ckpt/{name}"
            self.res[f"{tag}/extra_state"] = loaded.extra_state
            self.res[f"{tag}/rng_same"] = rng_draw() == draw
            self.res[f"{tag}/lr_same"] = again.scheduler.num_steps == 1
            m2_again = again.update(full, temperature=TEMPERATURE)
            self.res[f"{tag}/resume_weights_diff"] = max_state_diff(exported(again), after_step2)
            self.res[f"{tag}/resume_metrics_same"] = m2_again == m2
            self.res[f"{tag}/step2_moved_weights"] = max_state_diff(after_step2, saved_weights) > 0
            if dtype == "bf16":
                # the same resume with the main params taken from the loaded bf16 weights: not bit-identical,
                # which shows the check above would catch main params that were not restored
                rounded = ActorWorker(ModelConfig(dtype=dtype), actor_config(2, 2, None, dist_opt=dist_opt), dims,
                                      self.work / "actor", total_steps=4)
                load_worker_checkpoint(rounded, path)
                rounded.optimizer.reload_model_params()
                rounded.update(full, temperature=TEMPERATURE)
                self.res[f"{tag}/resume_from_rounded_main_params_diff"] = max_state_diff(exported(rounded),
                                                                                         after_step2)
            destroy()

        # Load at TP1xPP1 (DP4): model weights from either checkpoint, the plain optimizer state too.
        dims = init_distributed(1, 1, seed=1234)
        cfg_dist = actor_config(1, 1, None, dist_opt=True)
        actor = ActorWorker(ModelConfig(), cfg_dist, dims, self.work / "actor", total_steps=4)
        self.res["ckpt/dist_to_tp1_error"] = errors(lambda: load_worker_checkpoint(actor, ckpts[True][0],
                                                                                     load_rng=False))
        self.res["ckpt/rng_layout_error"] = errors(lambda: load_worker_checkpoint(actor, ckpts[True][0],
                                                                                   load_optimizer=False))
        load_worker_checkpoint(actor, ckpts[True][0], load_optimizer=False, load_rng=False)
        lp = actor.compute_log_prob(full, temperature=TEMPERATURE)
        self.res["ckpt/tp1_log_probs_vs_tp2pp2"] = (lp - ckpts[True][4]).abs().max().item()
        self.res["ckpt/tp1_weights_bitwise"] = max_state_diff(exported(actor), ckpts[True][3]) == 0.0

        plain = ActorWorker(ModelConfig(), actor_config(1, 1, None, dist_opt=False), dims, self.work / "actor",
                            total_steps=4)
        load_worker_checkpoint(plain, ckpts[False][0], load_rng=False)
        m2 = plain.update(dp_shard(full, dims.dp, dims.dp_rank), temperature=TEMPERATURE)
        self.res["ckpt/plain_tp1_resume_weights_diff"] = max_state_diff(exported(plain), ckpts[False][1])
        self.res["ckpt/plain_tp1_resume_pg_loss_diff"] = abs(m2["actor/pg_loss"] - ckpts[False][2]["actor/pg_loss"])

        # another model, and an incomplete directory
        tied = ActorWorker(ModelConfig(), cfg_dist, dims, self.work / "tied", total_steps=4)
        self.res["ckpt/other_model_error"] = errors(lambda: load_worker_checkpoint(tied, ckpts[True][0],
                                                                                    load_rng=False))
        self.res["ckpt/missing_error"] = errors(lambda: load_worker_checkpoint(actor, self.work / "nowhere"))
        destroy()

        # context parallelism: resume at CP2 x DP2 is bit-identical; the CP2 checkpoint loads at CP1 (TP1 DP4)
        dims = init_distributed(1, 1, cp=2, seed=1234)
        cfg = actor_config(1, 1, None, cp=2, micro=3)
        actor = ActorWorker(ModelConfig(), cfg, dims, self.work / "actor", total_steps=4)
        actor.update(full, temperature=TEMPERATURE)
        path = self.work / "ckpt_cp2"
        save_worker_checkpoint(actor, path, extra_state={})
        saved_weights, lp_cp2 = exported(actor), actor.compute_log_prob(full, temperature=TEMPERATURE)
        actor.update(full, temperature=TEMPERATURE)
        again = ActorWorker(ModelConfig(), cfg, dims, self.work / "actor", total_steps=4)
        load_worker_checkpoint(again, path)
        again.update(full, temperature=TEMPERATURE)
        self.res["ckpt/cp2_resume_weights_diff"] = max_state_diff(exported(again), exported(actor))
        destroy()
        dims = init_distributed(1, 1, seed=1234)
        actor = ActorWorker(ModelConfig(), actor_config(1, 1, None), dims, self.work / "actor", total_steps=4)
        self.res["ckpt/cp2_to_cp1_rng_error"] = errors(lambda: load_worker_checkpoint(actor, path,
                                                                                       load_optimizer=False))
        load_worker_checkpoint(actor, path, load_optimizer=False, load_rng=False)
        self.res["ckpt/cp2_to_cp1_weights_bitwise"] = max_state_diff(exported(actor), saved_weights) == 0.0
        self.res["ckpt/cp2_to_cp1_log_probs"] = (actor.compute_log_prob(full, temperature=TEMPERATURE)
                                                 - lp_cp2).abs().max().item()
        destroy()


def run_cases(opts, res: dict) -> None:
    cases = Cases(opts.out / "work", res, int(os.environ["RANK"]))
    cases.setup()
    for case in (cases.actor_layouts, cases.global_normalisation, cases.tied_embeddings, cases.nan_skip,
                 cases.bf16_training, cases.critic, cases.host_reads, cases.checkpoints):
        began = time.monotonic()
        case()
        res[f"wall_s/{case.__name__}"] = time.monotonic() - began  # what each case costs the launch
    began = time.monotonic()
    overlap_cases(cases.work, cases.batch, res, actor_config)
    res["wall_s/overlap_cases"] = time.monotonic() - began
    began = time.monotonic()
    lora_cases(cases, actor_config, TEMPERATURE, dp_shard)
    res["wall_s/lora_cases"] = time.monotonic() - began
    # Every layout switch above destroyed its groups: no model of an earlier layout may outlive it (each held its
    # gloo groups, and their threads, for the life of the process: mppo.parallel.destroy)
    from megatron.core.distributed import DistributedDataParallel

    from mppo.parallel import destroy

    destroy()
    gc.unfreeze()  # the rank froze what it inherited (dist_util._rank), and gc.get_objects() skips frozen objects
    res["leak/live_ddp_models"] = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    res["leak/threads"] = len(os.listdir(f"/proc/{os.getpid()}/task"))


def main() -> None:
    rank_main(run_cases)


if __name__ == "__main__":
    main()
