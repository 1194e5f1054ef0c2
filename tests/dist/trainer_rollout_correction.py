"""Rollout correction in the trainer under torchrun (run by tests/test_trainer_rollout_correction.py).

The rollout policy is deliberately perturbed: the CPU engine samples (and reports log-probs) at temperature
`--engine-temperature` while the actor's log-probs use rollout.temperature. Each case builds a fresh PPOTrainer
(same model and seed: same initial weights and prompts), runs one train_step and records what the actor update
received (its batch rows on this rank) and, in bypass mode, the actor's log-probs of that batch just before the
update. Rank R writes out/rank{R}.json: per case the step's metrics, those tensors as lists, and the distance of
the updated actor weights from those of the uncorrected perturbed case (None for a case at another TP layout).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import torch

from mppo.config.decisions import OldLogProbSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: dist_util
from dist_util import rank_main  # noqa: E402

CAPTURED = ("response_mask", "advantages", "old_log_probs", "rollout_log_probs", "rollout_is_weights")


def build(config: str, overrides: list[str]):
    from mppo.config import load_config
    from mppo.trainer.fit import PPOTrainer

    cfg = load_config(config, overrides, world_size=int(os.environ["WORLD_SIZE"]))
    return PPOTrainer(cfg)


def run_case(config: str, overrides: list[str], engine_temperature: float | None) -> tuple[dict, list[torch.Tensor]]:
    from mppo.parallel import destroy

    trainer = build(config, overrides)
    if engine_temperature is not None:  # the perturbation: the engine samples at another temperature
        trainer.train_sampling = dataclasses.replace(trainer.train_sampling, temperature=engine_temperature)
    captured: dict[str, list] = {}
    update = trainer.actor.update

    def recording_update(batch, **kwargs):
        captured.update({k: batch[k].detach().cpu().tolist() for k in CAPTURED if k in batch})
        if trainer.rollout_corr.bypass:  # what the update's first forward sees (same weights, no grad)
            log_probs = trainer.actor.compute_log_prob(batch, temperature=kwargs["temperature"])
            captured["actor_log_probs"] = log_probs.cpu().tolist()
        return update(batch, **kwargs)

    trainer.actor.update = recording_update
    prompts = next(iter(trainer.data.train_loader))
    metrics = {k: float(v) for k, v in trainer.train_step(prompts).items()}
    weights = [p.detach().clone() for chunk in trainer.actor.model for p in chunk.parameters()]
    source = trainer.old_log_prob_source
    result = {"metrics": metrics, "captured": captured, "reuse": source is OldLogProbSource.UPDATE_FORWARD,
              "pass": source is OldLogProbSource.ACTOR_PASS}
    trainer.watchdog.close()
    trainer.metrics.close()
    destroy()
    return result, weights


def run(args, result: dict) -> None:
    logging.basicConfig(level=logging.WARNING)
    base = json.loads(args.overrides)
    weights = {}
    for name, (extra, perturbed) in json.loads(args.cases).items():
        result[name], weights[name] = run_case(args.config, base + extra,
                                               args.engine_temperature if perturbed else None)
    reference = weights["perturbed_plain"]
    for name in result:  # None for a case at another layout (its shards have other shapes)
        same_layout = [a.shape for a in weights[name]] == [b.shape for b in reference]
        result[name]["weights_diff_to_plain"] = (max((a - b).abs().max().item()
                                                     for a, b in zip(weights[name], reference))
                                                 if same_layout else None)


def main() -> None:
    def arguments(p):
        p.add_argument("--config", required=True)
        p.add_argument("--overrides", required=True, help="JSON list of the base overrides")
        p.add_argument("--cases", required=True, help="JSON {name: [overrides, perturbed (bool)]}")
        p.add_argument("--engine-temperature", type=float, required=True)

    rank_main(run, add_arguments=arguments, process_group=False)


if __name__ == "__main__":
    main()
