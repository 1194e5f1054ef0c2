"""On-policy reuse of the update's log-probs as old log-probs, under torchrun (run by tests/test_trainer_onpolicy.py).

Each case builds a fresh PPOTrainer (same model directory, same seed: same initial weights and rollouts) and runs
its first train_step, then tears the layout down for the next case. Rank R writes out/rank{R}.json:
  metrics per case, the flag the trainer decided, and the actor's weights' distance between the reuse and the
  recompute cases (DP 2), plus a reuse case at PP 2.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from mppo.config.decisions import OldLogProbSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: dist_util
from dist_util import rank_main  # noqa: E402


def build(config: str, overrides: list[str]):
    from mppo.config import load_config
    from mppo.trainer.fit import PPOTrainer

    cfg = load_config(config, overrides, world_size=int(os.environ["WORLD_SIZE"]))
    return PPOTrainer(cfg)


def close(trainer) -> None:
    from mppo.parallel import destroy

    trainer.watchdog.close()
    trainer.metrics.close()
    destroy()


def first_step(trainer) -> dict[str, float]:
    prompts = next(iter(trainer.data.train_loader))
    metrics = trainer.train_step(prompts)
    return {k: float(v) for k, v in metrics.items()}


def reuses(trainer) -> bool:
    """Whether the trainer takes the old log-probs from the update's own forward."""
    return trainer.old_log_prob_source is OldLogProbSource.UPDATE_FORWARD


def actor_weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in trainer.actor.model for p in chunk.parameters()]


def run(args, result: dict) -> None:
    logging.basicConfig(level=logging.WARNING)
    base = json.loads(args.overrides)

    weights = {}
    for name, extra in (("reuse", ["actor_rollout_ref.actor.reuse_on_policy_log_prob=true"]),
                        ("recompute", ["actor_rollout_ref.actor.reuse_on_policy_log_prob=false"])):
        trainer = build(args.config, base + extra)
        before = actor_weights(trainer)
        result[name] = {"reuse": reuses(trainer), "metrics": first_step(trainer)}
        weights[name] = actor_weights(trainer)
        result[name]["weights_moved"] = max((a - b).abs().max().item() for a, b in zip(weights[name], before))
        close(trainer)
    result["weights_max_abs_diff"] = max((a - b).abs().max().item()
                                         for a, b in zip(weights["reuse"], weights["recompute"]))

    # Reuse with two pipeline stages (DP 1): the update's log-probs come from the last stage to every rank.
    trainer = build(args.config, base + ["actor_rollout_ref.actor.reuse_on_policy_log_prob=true",
                                         "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
    result["reuse_pp2"] = {"reuse": reuses(trainer), "metrics": first_step(trainer)}
    close(trainer)

    # Not on-policy: the flag stays on in the config, the trainer recomputes old log-probs (the phase runs).
    for name, extra in (("two_epochs", ["actor_rollout_ref.actor.ppo_epochs=2"]),
                        ("two_mini_batches", ["actor_rollout_ref.actor.ppo_mini_batch_size=4"])):
        trainer = build(args.config, base + extra + ["actor_rollout_ref.actor.reuse_on_policy_log_prob=true"])
        update, updated = trainer.actor.update, []
        trainer.actor.update = lambda batch, **kwargs: updated.append(batch) or update(batch, **kwargs)
        result[name] = {"reuse": reuses(trainer), "metrics": first_step(trainer)}
        # The actor refuses old log-probs from its own forward when the update is not on-policy.
        try:
            update(updated[0], temperature=trainer.cfg.actor_rollout_ref.rollout.temperature,
                   old_log_prob_from_update=True)
            result[name]["actor_refused"] = ""
        except ValueError as err:
            result[name]["actor_refused"] = str(err)
        close(trainer)


def main() -> None:
    def arguments(p):
        p.add_argument("--config", required=True)
        p.add_argument("--overrides", required=True, help="JSON list of the base overrides")

    rank_main(run, add_arguments=arguments, process_group=False)


if __name__ == "__main__":
    main()
