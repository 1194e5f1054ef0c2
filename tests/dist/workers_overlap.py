"""Overlapped communication (megatron.overlap_grad_reduce / overlap_param_gather) against the same runs without it,
a case of tests/dist/workers_parallel.py's launch (4 CPU ranks, gloo).

Each layout runs two actor updates of two optimizer steps each (two micro-batches per step and rank), with a
log-prob pass after each update: the step's deferred parameter all-gather must then happen in the next forward
(the second mini-batch's, the log-prob pass's) and before the weights are read outside a forward (the export).
The DDP buckets are made small so that the tiny model has several: each bucket's reduction starts on its own in
the backward, and the all-gathers run bucket by bucket. References: the same layout with overlap off.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from workers_fixtures import TEMPERATURE, dp_shard, max_state_diff

# (tp, pp, vpp, distributed optimizer): DP2 with SP, DP2 x PP2 (1F1B), interleaved PP2 x DP2, DP4 without the
# distributed optimizer (overlap_grad_reduce only: overlap_param_gather needs it)
LAYOUTS = [(2, 1, None, True), (1, 2, None, True), (1, 2, 2, True), (1, 1, None, False)]
BUCKET_SIZE = 6_000  # parameters per DDP bucket: several buckets of the tiny model (megatron's default: 4e7)


def layout_name(tp: int, pp: int, vpp: int | None, dist_opt: bool) -> str:
    return f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "") + ("" if dist_opt else "_plain")


def overlap_cases(work: Path, batch: dict, res: dict, actor_config: Callable) -> None:
    from mppo.config.schema import ModelConfig
    from mppo.parallel import destroy, init_distributed
    from mppo.workers import optim
    from mppo.workers.actor import ActorWorker

    def run(tp, pp, vpp, dist_opt, overlap: bool, dims) -> dict:
        cfg = actor_config(tp, pp, vpp, dist_opt=dist_opt)
        cfg.megatron.overlap_grad_reduce = overlap
        cfg.megatron.overlap_param_gather = overlap and dist_opt
        actor = ActorWorker(ModelConfig(), cfg, dims, work / "actor", total_steps=4)
        ddp = actor.model[0]
        out = {"flags": [ddp.ddp_config.overlap_grad_reduce, ddp.ddp_config.overlap_param_gather],
               "buckets": len(ddp.bucket_groups), "metrics": [], "log_probs": [], "weights": []}
        shard = dp_shard(batch, dims.dp, dims.dp_rank)
        for _ in range(2):  # the weights are read right after the update, as the rollout's weight sync does
            out["metrics"].append(actor.update(shard, temperature=TEMPERATURE))
            out["weights"].append({n: t.clone() for b in actor.export_hf_weights(1 << 16) for n, t in b})
            out["log_probs"].append(actor.compute_log_prob(shard, temperature=TEMPERATURE))
        return out

    def run_critic(overlap: bool, dims) -> dict:
        from mppo.config.schema import CriticConfig, MegatronConfig, OptimConfig
        from mppo.workers.critic import CriticWorker

        megatron = MegatronConfig(tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
                                  use_distributed_optimizer=True, seed=0, overlap_grad_reduce=overlap,
                                  overlap_param_gather=overlap)
        cfg = CriticConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False,
                           ppo_epochs=1, cliprange_value=0.2, loss_agg_mode="token-mean",
                           optim=OptimConfig(lr=1e-2, eps=1e-3, clip_grad=1.0, weight_decay=0.0), megatron=megatron)
        critic = CriticWorker(ModelConfig(), cfg, dims, work / "critic", total_steps=4)
        shard = dp_shard(batch, dims.dp, dims.dp_rank)
        out = {"metrics": [], "weights": [], "values": []}
        for _ in range(2):
            out["metrics"].append(critic.update(shard))
            out["weights"].append({n: t.clone() for b in critic.export_hf_weights(1 << 16) for n, t in b})
            out["values"].append(critic.compute_values(shard))
        return out

    optim.BUCKET_SIZE = BUCKET_SIZE
    try:
        dims = init_distributed(2, 1, seed=1234)
        off, on = run_critic(False, dims), run_critic(True, dims)
        res["overlap/critic/weights_diff"] = max(max_state_diff(a, b) for a, b in zip(on["weights"], off["weights"]))
        res["overlap/critic/values_diff"] = max((a - b).abs().max().item() for a, b in zip(on["values"], off["values"]))
        res["overlap/critic/metrics_rel_diff"] = max(abs(a[k] - b[k]) / max(abs(b[k]), 1.0)
                                                     for a, b in zip(on["metrics"], off["metrics"])
                                                     for k in a if isinstance(a[k], float))
        destroy()
        for tp, pp, vpp, dist_opt in LAYOUTS:
            key = f"overlap/{layout_name(tp, pp, vpp, dist_opt)}"
            dims = init_distributed(tp, pp, vpp, seed=1234)
            off = run(tp, pp, vpp, dist_opt, False, dims)
            on = run(tp, pp, vpp, dist_opt, True, dims)
            res[f"{key}/flags"] = [off["flags"], on["flags"]]
            res[f"{key}/buckets"] = [off["buckets"], on["buckets"]]
            res[f"{key}/weights_diff"] = max(max_state_diff(a, b) for a, b in zip(on["weights"], off["weights"]))
            res[f"{key}/log_probs_diff"] = max((a - b).abs().max().item()
                                               for a, b in zip(on["log_probs"], off["log_probs"]))
            # relative: the reductions run over other bucket sizes, so gloo's ring sums some elements in another
            # order (1 ulp); grad_norm is ~10
            res[f"{key}/metrics_rel_diff"] = max(abs(a[k] - b[k]) / max(abs(b[k]), 1.0)
                                                 for a, b in zip(on["metrics"], off["metrics"])
                                                 for k in a if isinstance(a[k], float))
            res[f"{key}/metrics_worst"] = max(((abs(a[k] - b[k]), k) for a, b in zip(on["metrics"], off["metrics"])
                                               for k in a if isinstance(a[k], float)))[1]
            res[f"{key}/metric_keys_same"] = [sorted(a) == sorted(b) for a, b in zip(on["metrics"], off["metrics"])]
            res[f"{key}/skipped"] = [m["skipped"] for m in on["metrics"] + off["metrics"]]
            res[f"{key}/weights_moved"] = max_state_diff(off["weights"][0], exported_initial(work))
            destroy()
    finally:
        optim.BUCKET_SIZE = None


def exported_initial(work: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(work / "actor" / "model.safetensors"))
