"""LoRA's initial adapters, on 2 CPU ranks (tests/test_lora_init.py asserts on the results).

seed: ActorWorkers built at TP2 and at TP1 (DP2) with megatron.seed 0 and 5 (the seed the trainer resolves from
trainer.seed): the gathered initial A per seed, compared across layouts and seeds.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import make_hf_model  # noqa: E402

MODEL = "qwen2_untied"
SEEDS = (0, 5)


def _actor_config(tp: int, seed: int):
    from mppo.config.schema import ActorConfig, MegatronConfig

    cfg = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, kernel_backend="torch")
    cfg.megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, seed=seed)
    return cfg


def seed_cases(work: Path, res: dict) -> None:
    from mppo.config.schema import LoRAConfig, ModelConfig
    from mppo.models.lora_io import gather_peft_tensors
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.actor import ActorWorker

    initial: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for tp in (2, 1):
        for seed in SEEDS:
            dims = init_distributed(tp, 1, seed=1234)
            actor = ActorWorker(ModelConfig(lora=LoRAConfig(rank=4, alpha=8.0, target_modules=["all-linear"])),
                                _actor_config(tp, seed), dims, work / MODEL, total_steps=1)
            initial[tp, seed] = gather_peft_tensors(actor.model)
            del actor
            destroy()
    a_keys = sorted(k for k in initial[1, 0] if ".lora_A." in k)
    res["seed/a_keys"] = len(a_keys)
    res["seed/same_keys"] = all(sorted(t) == sorted(initial[1, 0]) for t in initial.values())
    for seed in SEEDS:  # TP2 (A split over TP for o/down, replicated for the rest) vs TP1: the same full tensors
        res[f"seed/{seed}/tp2_equals_tp1"] = all(torch.equal(initial[2, seed][k], initial[1, seed][k]) for k in a_keys)
    res["seed/other_seed_differs"] = all(not torch.equal(initial[1, 0][k], initial[1, 5][k]) for k in a_keys)
    res["seed/b_zero"] = all(not t.any() for v in initial.values() for k, t in v.items() if ".lora_B." in k)


def main(opts, res: dict) -> None:
    work = opts.out / "work"
    if dist.get_rank() == 0:
        make_hf_model(MODEL, work / MODEL, seed=0)
    dist.barrier()
    seed_cases(work, res)


if __name__ == "__main__":
    rank_main(main)
