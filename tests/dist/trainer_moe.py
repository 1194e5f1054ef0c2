"""PPO / GRPO on a tiny Qwen3-MoE under torchrun (run by tests/test_trainer_moe.py): each case builds a fresh
PPOTrainer (same model and seed: the same initial weights, prompts and rollouts), then either runs one train_step
and records its metrics and the updated actor weights (as full HF tensors), or runs `fit()` to its end.

Kind "step_engine_routers_perturbed" is a step whose rollout engine serves router weights slightly off the actor's
(ENGINE_ROUTER_NOISE x each router matrix's std, the same noise on every rank and step): a controlled source of
train-rollout routing mismatch, as a bf16 or quantised engine has, for the routing-replay cases.

Rank R writes out/rank{R}.json: {case: {"metrics": ..., "weights_diff": ...}}; fit cases leave their metrics in
their run directory's metrics.jsonl. The updated weights of a step case are compared in this process with those of
its reference case (`weights_diff`: max |a - b| over every HF tensor).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: dist_util
from dist_util import rank_main  # noqa: E402


def build(config: str, overrides: list[str]):
    from mppo.config import load_config
    from mppo.trainer.fit import PPOTrainer

    return PPOTrainer(load_config(config, overrides, world_size=int(os.environ["WORLD_SIZE"])))


ENGINE_ROUTER_NOISE = 0.05


def perturb_engine_routers(engine, relative: float) -> None:
    """Every later update_weights of `engine` adds relative x std x N(0, 1) noise (seeded by the weight's name)
    to the MoE router weights (`*.mlp.gate.weight`); the actor keeps its own."""
    import zlib

    from mppo.rollout.base import iter_weight_buckets

    def noisy(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if not name.endswith("mlp.gate.weight"):
            return tensor
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return tensor + relative * tensor.float().std() * torch.randn(tensor.shape, generator=g).to(tensor.dtype)

    original = engine.update_weights
    engine.update_weights = lambda stream: original(
        [(name, noisy(name, t)) for name, t in bucket] for bucket in iter_weight_buckets(stream))


def one_step(config: str, overrides: list[str], perturb: bool = False) -> tuple[dict, dict[str, torch.Tensor]]:
    from mppo.models.weights import iter_hf_weights
    from mppo.parallel import destroy

    trainer = build(config, overrides)
    if perturb:
        perturb_engine_routers(trainer.rollout.engine, ENGINE_ROUTER_NOISE)
    prompts = next(iter(trainer.data.train_loader))
    metrics = {k: float(v) for k, v in trainer.train_step(prompts).items()}
    weights = {name: t.clone() for name, t in iter_hf_weights(trainer.actor.model, trainer.actor.hf_args)}
    trainer.watchdog.close()
    trainer.metrics.close()
    destroy()
    return {"metrics": metrics}, weights


def fit(config: str, overrides: list[str]) -> dict:
    from mppo.parallel import destroy

    trainer = build(config, overrides)
    resumed_from = trainer.resume_from.step if trainer.resume_from is not None else None
    trainer.fit()
    destroy()
    return {"resumed_from": resumed_from}


def run(args, result: dict) -> None:
    logging.basicConfig(level=logging.WARNING)
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for name, (kind, overrides, reference) in json.loads(args.cases).items():
        if kind == "fit":
            result[name] = fit(args.config, overrides)
            continue
        result[name], weights[name] = one_step(args.config, overrides,
                                               perturb=kind == "step_engine_routers_perturbed")
        if reference is not None:
            ref = weights[reference]
            assert sorted(ref) == sorted(weights[name])
            result[name]["weights_diff"] = max((weights[name][k] - ref[k]).abs().max().item() for k in ref)


def main() -> None:
    def arguments(p):
        p.add_argument("--config", required=True)
        p.add_argument("--cases", required=True, help='JSON {name: ["step" | "step_engine_routers_perturbed" | "fit", '
                                                       'overrides, reference case | null]}')

    rank_main(run, add_arguments=arguments, process_group=False)


if __name__ == "__main__":
    main()
