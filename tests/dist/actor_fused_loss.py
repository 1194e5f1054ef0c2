"""torchrun script (2 CPU ranks, gloo): the actor update through the fused gradient-in-forward loss kernel against
the reference path, at TP1 (DP2) and TP2 (DP1). Run by tests/test_actor_fused_loss.py.

For each loss config, three actors start from the same HF weights and run the same update (two mini-batches,
two optimizer steps): `fused` (logprob_impl=fused: the config's loss is covered, so the fused loss kernel runs),
`naive` (logprob_impl=naive: megatron's vocab-parallel cross entropy on full logits, then core_algos) and
`recompute` (fused log-prob op + core_algos: the path the fused loss replaces). Writes out/rank{R}.json with, per
layout and case: the path each actor took, max |weight difference| after the update, and metric differences.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import load_hf_model, make_hf_model  # noqa: E402
from workers_fixtures import TEMPERATURE, dp_shard, hf_response_logprobs, make_batch, max_state_diff  # noqa: E402

METRICS = ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl",
           "actor/pg_clipfrac_lower", "actor/grad_norm")
# name -> (ActorConfig overrides, use rollout IS weights, old log-probs from the update's forward)
CASES = {
    "token-mean/k3/isw": (dict(loss_agg_mode="token-mean", kl_loss_type="low_var_kl"), True, False),
    "seq-mean-token-sum-norm/k2+/clip-higher": (dict(loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="k2+",
                                                     clip_ratio_high=0.35, clip_ratio_c=2.0), False, False),
    "seq-mean-token-mean/on-policy": (dict(loss_agg_mode="seq-mean-token-mean", kl_loss_type="abs",
                                           ppo_mini_batch_size=8), False, True),
}
LAYOUTS = (1, 2)  # TP; DP = 2 / TP


def actor_config(tp: int, impl: str, overrides: dict):
    from mppo.config.schema import ActorConfig, MegatronConfig, OptimConfig

    kwargs = dict(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                  clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                  logprob_impl=impl, kernel_backend="torch")
    cfg = ActorConfig(**{**kwargs, **overrides})
    cfg.optim = OptimConfig(lr=1e-2, eps=1e-3, clip_grad=1.0, weight_decay=0.0)
    cfg.megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                  use_distributed_optimizer=True, recompute="none", seed=0)
    return cfg


def exported(worker) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in worker.export_hf_weights(1 << 16) for n, t in bucket}


def run(work: Path, res: dict) -> None:
    from mppo.config.schema import ModelConfig
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.actor import ActorWorker
    from mppo.workers.loss_selection import LossPath

    if dist.get_rank() == 0:
        make_hf_model("qwen2_untied", work / "actor", seed=0)
    dist.barrier()
    hf = load_hf_model(work / "actor")
    batch = make_batch(hf.config.vocab_size, seed=0)
    with torch.no_grad():
        lp, _ = hf_response_logprobs(hf, batch)
    g = torch.Generator().manual_seed(5)
    mask = batch["response_mask"]
    batch["old_log_probs"] = (lp + 0.3 * torch.randn(lp.shape, generator=g)) * mask
    batch["ref_log_prob"] = (lp + 0.2 * torch.randn(lp.shape, generator=g)) * mask
    batch["rollout_is_weights"] = 0.5 + torch.rand(lp.shape, generator=g)
    for tp in LAYOUTS:
        dims = init_distributed(tp, 1, seed=1234)
        shard = dp_shard(batch, dims.dp, dims.dp_rank)
        for case, (overrides, isw, on_policy) in CASES.items():
            data = dict(shard) if isw else {k: v for k, v in shard.items() if k != "rollout_is_weights"}
            key = f"tp{tp}/{case}"
            weights, metrics, forward_lp = {}, {}, {}
            for path in ("fused", "naive", "recompute"):
                actor = ActorWorker(ModelConfig(), actor_config(tp, "naive" if path == "naive" else "fused",
                                                                overrides), dims, work / "actor", total_steps=4)
                if path == "recompute":  # the fused log-prob op + core_algos, as before the fused loss
                    actor.loss_path = LossPath(False, "test: recompute path")
                res[f"{key}/{path}/fused_loss"] = actor.loss_path.fused
                metrics[path] = actor.update(dict(data), temperature=TEMPERATURE,
                                             old_log_prob_from_update=on_policy)
                weights[path] = exported(actor)
                forward_lp[path] = actor.forward_log_probs
            res[f"{key}/moved"] = max_state_diff(weights["fused"], {k: v for k, v in hf.state_dict().items()
                                                                    if k in weights["fused"]})
            for other in ("naive", "recompute"):
                res[f"{key}/weights_vs_{other}"] = max_state_diff(weights["fused"], weights[other])
                res[f"{key}/metrics_vs_{other}"] = {
                    m: abs(metrics["fused"][m] - metrics[other][m]) / max(abs(metrics[other][m]), 1.0)
                    for m in METRICS}
            res[f"{key}/metrics"] = metrics["fused"]
            if on_policy:  # the old log-probs the update took from its own (fused) forward, as the trainer reads them
                res[f"{key}/forward_log_probs_vs_naive"] = float(
                    (forward_lp["fused"] - forward_lp["naive"]).abs().max())
        destroy()


def main() -> None:
    rank_main(lambda opts, res: run(opts.out / "work", res))


if __name__ == "__main__":
    main()
