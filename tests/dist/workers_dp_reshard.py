"""torchrun script: a distributed-optimizer checkpoint (dp_reshardable) saved at DP2 resumes at DP1.

Run twice on the same --out: `--mode save` on 2 ranks (TP1xPP1, DP2: step 1, save, step 2, record the weights),
then `--mode load` on 1 rank (load, step 2, compare with the recorded weights). Writes out/rank{R}.json.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import make_hf_model  # noqa: E402
from workers_fixtures import TEMPERATURE, dp_shard, make_batch, max_state_diff  # noqa: E402


def run(mode: str, work: Path, res: dict) -> None:
    import torch.distributed as dist

    from mppo.config.schema import ActorConfig, ModelConfig, OptimConfig
    from mppo.parallel import init_distributed
    from mppo.workers.actor import ActorWorker
    from mppo.workers.worker_checkpoint import load_worker_checkpoint, save_worker_checkpoint

    dims = init_distributed(1, 1, seed=1234)
    if mode == "save" and dims.rank == 0:
        make_hf_model("llama_untied", work / "hf", seed=2)
    dist.barrier()
    cfg = ActorConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, use_kl_loss=False, logprob_impl="naive")
    cfg.optim = OptimConfig(lr=1e-2, eps=1e-3, weight_decay=0.0)
    cfg.megatron.use_distributed_optimizer = True
    batch = make_batch(1001, seed=4)
    batch["old_log_probs"] = -7.0 * batch["response_mask"]
    shard = dp_shard(batch, dims.dp, dims.dp_rank)
    actor = ActorWorker(ModelConfig(), cfg, dims, work / "hf", total_steps=4)
    if mode == "save":
        actor.update(shard, temperature=TEMPERATURE)
        save_worker_checkpoint(actor, work / "ckpt")
        actor.update(shard, temperature=TEMPERATURE)
        weights = {n: t for bucket in actor.export_hf_weights(1 << 20) for n, t in bucket}
        if dims.rank == 0:
            from safetensors.torch import save_file

            save_file(weights, str(work / "step2.safetensors"))
    else:
        from safetensors.torch import load_file

        loaded = load_worker_checkpoint(actor, work / "ckpt", load_rng=False)
        res["saved_dp"] = loaded.saved_layout["dp"]
        actor.update(shard, temperature=TEMPERATURE)
        weights = {n: t for bucket in actor.export_hf_weights(1 << 20) for n, t in bucket}
        res["step2_diff"] = max_state_diff(weights, load_file(str(work / "step2.safetensors")))
    res["dp"] = dims.dp


def main() -> None:
    rank_main(lambda opts, res: run(opts.mode, opts.out / "work", res), process_group=False,
              add_arguments=lambda parser: parser.add_argument("--mode", choices=["save", "load"], required=True))


if __name__ == "__main__":
    main()
