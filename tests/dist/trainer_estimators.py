"""Every registered advantage estimator runs 2 trainer steps (run by tests/test_trainer_estimators.py).

One process (TP=PP=DP=1): for each name in ADV_ESTIMATOR_REGISTRY a fresh PPOTrainer runs two train_steps. The
step-1 batch the advantages were computed on is recorded, and for the estimators with extra inputs an independent
HF transformers reference is computed from the initial weights (= the weights of step 1's rollout):
  * remax: HF greedy generation of each prompt, scored by the run's reward function -> the expected baselines;
  * optimal_token_baseline / tir_...: softmax(HF logits / T) -> sum_v p^2 at each response token, and log p.
Writes out/rank0.json.
"""
from __future__ import annotations

import json
import logging
import time
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: dist_util
from dist_util import hf_response_log_softmax, rank_main  # noqa: E402

from trainer_onpolicy import build, close  # same directory: one way to build and tear down a trainer


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy_baselines(trainer, prompts, model) -> list[float]:
    """Greedy responses by HF `generate` (stop at eos, eos kept, at most max_response_length tokens), scored by the
    run's reward manager: one score per prompt."""
    tok, max_len = trainer.data.tokenizer, trainer.cfg.data.max_response_length
    responses = torch.full((len(prompts.raw_prompts), max_len), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(responses.shape)
    with torch.no_grad():
        for i in range(len(prompts.raw_prompts)):
            ids = prompts.input_ids[i][prompts.attention_mask[i].bool()][None]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_len, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, ids.shape[1]:]
            stop = (out == tok.eos_token_id).nonzero()
            length = int(stop[0]) + 1 if len(stop) else len(out)
            responses[i, :length], mask[i, :length] = out[:length], 1.0
    scores, _ = trainer.data.reward(prompts.raw_prompts, responses, mask, prompts.data_sources,
                                    prompts.ground_truths, prompts.extra_infos)
    return scores.sum(-1).tolist()


def hf_token_stats(batch, model, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(response token), sum_v p_v^2) [B, T] from HF logits of the batch's sequences."""
    logp = hf_response_log_softmax(batch, model, temperature)
    token_logp = logp.gather(-1, batch["responses"][..., None]).squeeze(-1)
    return token_logp, logp.exp().pow(2).sum(-1)


def run(args, result: dict) -> None:
    logging.basicConfig(level=logging.WARNING)
    from mppo.core_algos import ADV_ESTIMATOR_REGISTRY

    base = json.loads(args.overrides)
    for name in args.only or sorted(ADV_ESTIMATOR_REGISTRY):
        start = time.perf_counter()
        trainer = build(args.config, base + [f"algorithm.adv_estimator={name}"])
        built = time.perf_counter()
        captured: list[dict] = []
        compute = trainer.compute_advantages

        def recording(batch, compute=compute, captured=captured):
            metrics = compute(batch)
            captured.append({k: v.clone() for k, v in batch.items()})
            return metrics

        trainer.compute_advantages = recording
        loader = iter(trainer.data.train_loader)
        first_prompts = next(loader)
        steps = [trainer.train_step(first_prompts)]
        trainer.step += 1
        steps.append(trainer.train_step(next(loader)))
        batch = captured[0]
        case = {"seconds": {"build": built - start, "steps": time.perf_counter() - built},
                "steps": [{k: float(v) for k, v in m.items()} for m in steps],
                "advantages_finite": bool(torch.isfinite(batch["advantages"]).all()),
                "advantages_nonzero": bool(batch["advantages"].abs().sum() > 0),
                "batch_keys": sorted(batch),
                # what the update receives, against mppo.workers.batch_schema (tests/test_batch_schema.py)
                "batch_specs": {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in batch.items()}}
        needs = ADV_ESTIMATOR_REGISTRY[name].needs
        if "reward_baselines" in needs:
            model = hf_model(trainer.cfg.actor_rollout_ref.model.path)
            case["reward_baselines"] = batch["reward_baselines"].tolist()
            case["hf_greedy_baselines"] = hf_greedy_baselines(trainer, first_prompts, model)
            case["scores"] = batch["token_level_scores"].sum(-1).tolist()
        if "sum_pi_squared" in needs:
            model = hf_model(trainer.cfg.actor_rollout_ref.model.path)
            logp, sum_p2 = hf_token_stats(batch, model, trainer.cfg.actor_rollout_ref.rollout.temperature)
            mask = batch["response_mask"].bool()
            case["sum_pi_squared_max_err"] = float((batch["sum_pi_squared"] - sum_p2)[mask].abs().max())
            case["sum_pi_squared_off_mask_max"] = float(batch["sum_pi_squared"][~mask].abs().max()) \
                if (~mask).any() else 0.0
            case["old_log_probs_max_err"] = float((batch["old_log_probs"] - logp)[mask].abs().max())
            case["sum_pi_squared_range"] = [float(sum_p2[mask].min()), float(sum_p2[mask].max())]
        result[name] = case
        close(trainer)


def main() -> None:
    def arguments(p):
        p.add_argument("--config", required=True)
        p.add_argument("--overrides", required=True, help="JSON list of the base overrides")
        p.add_argument("--only", nargs="*", help="these estimators only (profiling)")

    rank_main(run, add_arguments=arguments, process_group=False)


if __name__ == "__main__":
    main()
