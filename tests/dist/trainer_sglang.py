"""The trainer on a REAL sglang.Engine (SGLang's CPU tier), under torchrun with 2 ranks (tests/test_trainer_sglang.py).

Engine start-up is the slow part (20-60 s), so one Rollout (two engines of TP 1: one per rank) serves the trainers
built one after another on the same model config (PPOTrainer's `rollout` argument): PPO (GAE + critic) at trainer
TP2, then at trainer DP2, each `fit()` for 3 steps, then the LoRA (merged) and multi-turn GRPO cases. Checked along
the way, and written to out/rank{R}.json (with each case's wall time, `wall_s`):
- greedy rollouts of the same prompts at trainer TP2 and TP1 x DP2, with the same initial weights (equal);
- sampled rollouts of the same request twice (SGLang's CPU tier ignores sampling_seed: they differ);
- the engine's weights after a push against the exporter's HF tensors, every tensor (bitwise);
- per step, the rollout's and the actor's token probabilities (veRL's rollout_probs_diff_max; the trainer's
  metrics.jsonl has its own);
- the SGLang calls and trainer-state offload calls of every phase, in order (the memory choreography);
- trainer-state offload + reload on the CPU (forced on: the trainer skips it there): storage freed, then every
  parameter and optimizer tensor bitwise back.
The multi-turn case (GRPO with the calculator tool, tests/e2e_assets.py's make_tool_policy: a model that calls it)
runs on the same engines (same config, its own weights, pushed) and records its update batch's rows.
A case on a different model (the Qwen3-MoE case: GRPO at EP2 with routing replay, R3) gets its own Rollout (the
previous one is shut down first: a checkpoint save after that shutdown is what found SGLang killing the rank's
dist-checkpoint Manager, mppo.rollout.sglang_startup.stop_engine); after its fit(): the trained weights, exported by the shared exporter (experts
included) and loaded into HF transformers, give the log-probs the engine returns after a sync, and HF's routers
choose the experts the engine reports for the same tokens (`moe_check`).
The LoRA adapter-only case (lora.merge=false) gets its own Rollout too (engines started with SGLang's LoRA
support): the engine's weights are then the base, bitwise, and after fit() its log-probs on the trained adapters
equal HF transformers + PEFT loaded with the actor's adapters (`adapter_check`).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: dist_util
from dist_util import rank_main  # noqa: E402


def load(config: str, overrides: list[str]):
    from mppo.config import load_config

    return load_config(config, overrides, world_size=int(os.environ["WORLD_SIZE"]))


def close(trainer) -> None:
    from mppo.parallel import destroy

    trainer.watchdog.close()
    trainer.metrics.close()
    destroy()


def prompt_ids(trainer) -> list[list[int]]:
    prompts = next(iter(trainer.data.train_loader))
    return [row[mask.bool()].tolist() for row, mask in zip(prompts.input_ids, prompts.attention_mask)]


def rollout_once(trainer, sampling) -> list[dict]:
    trainer.sync_weights()
    responses = trainer.rollout.generate(prompt_ids(trainer), sampling, step=0)
    trainer.rollout.release()
    return [{"tokens": r.token_ids, "log_probs": r.log_probs} for r in responses]


def weights_vs_exporter(trainer) -> dict:
    """Push, then compare every HF tensor the exporter streams with what this rank's engine holds (the actor's
    state stays in place: the exporter reads it again)."""
    from mppo.models.weights import iter_hf_weights

    trainer.rollout.sync_weights(trainer.actor.model, trainer.actor.hf_args, bucket_bytes=1 << 20)
    everyone = trainer.rollout.layout.destinations
    compared, different, missing = 0, [], []
    for name, tensor in iter_hf_weights(trainer.actor.model, trainer.actor.hf_args, destinations=everyone):
        got = trainer.rollout.engine.get_weight(name)
        if got is None:
            missing.append(name)
            continue
        compared += 1
        # SGLang may pad the vocabulary dimension of its embedding/head; the HF rows must match exactly
        if got.shape[0] < tensor.shape[0] or not torch.equal(got[:tensor.shape[0]], tensor.float()):
            different.append(name)
        last = (name, got)
    trainer.rollout.release()
    # SGLang's CPU tier has no memory saver: release_memory_occupation frees nothing, the weights stay readable
    kept = trainer.rollout.engine.get_weight(last[0])
    return {"compared": compared, "different": different, "missing": missing,
            "readable_after_release": kept is not None and torch.equal(kept, last[1])}


def merged_vs_base(trainer, base_dir: Path) -> float:
    """The largest change the trained adapters make to any base weight (the exporter merges them): > 0 shows that
    what reached the engine was not just the base."""
    from safetensors.torch import load_file

    from mppo.models.weights import iter_hf_weights

    base = {}
    for file in sorted(base_dir.glob("*.safetensors")):
        base.update(load_file(file))
    worst = 0.0
    for name, tensor in iter_hf_weights(trainer.actor.model, trainer.actor.hf_args):
        worst = max(worst, (tensor.float() - base[name].float()).abs().max().item())
    return worst


def base_vs_exporter(trainer) -> dict:
    """Adapter-only sync: every HF tensor the engine holds equals the exporter's base (adapters off), bitwise,
    and the engine's tensors differ from the merged weights (the adapters did not reach them merged)."""
    from mppo.models.lora import adapters_disabled
    from mppo.models.weights import iter_hf_weights

    chunks, args = trainer.actor.model, trainer.actor.hf_args
    everyone = trainer.rollout.layout.destinations
    merged = {name: t.float().clone() for name, t in iter_hf_weights(chunks, args, destinations=everyone)}
    different, missing, equal_to_merged = [], [], 0
    with adapters_disabled(chunks):
        for name, tensor in iter_hf_weights(chunks, args, destinations=everyone):
            got = trainer.rollout.engine.get_weight(name)
            if got is None:
                missing.append(name)
                continue
            if got.shape[0] < tensor.shape[0] or not torch.equal(got[:tensor.shape[0]], tensor.float()):
                different.append(name)
            equal_to_merged += int(torch.equal(got[:tensor.shape[0]], merged[name]))
    return {"compared": len(merged) - len(missing), "different": different, "missing": missing,
            "equal_to_merged": equal_to_merged, "tensors": len(merged)}


def adapter_check(trainer, out_dir: Path) -> dict:
    """After fit(): sync (adapters only), then greedy and sampled rollouts, against HF transformers + PEFT with the
    actor's adapters written as a PEFT directory (mppo's exporter) on the base model's files."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mppo.models.lora import lora_info
    from mppo.models.lora_io import gather_peft_tensors, save_peft_adapter
    from mppo.rollout import SamplingParams

    chunks = trainer.actor.model
    info = lora_info(chunks)
    save_peft_adapter(gather_peft_tensors(chunks), out_dir, info.spec, base_model=info.base_dir, overwrite=True)
    stats = trainer.rollout.sync_weights(chunks, trainer.actor.hf_args, bucket_bytes=1 << 20)
    prompts = prompt_ids(trainer)
    eos = tuple(trainer.train_sampling.stop_token_ids)
    greedy = trainer.rollout.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=12,
                                                             stop_token_ids=eos), step=0)
    sampled = trainer.rollout.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12,
                                                              stop_token_ids=eos), step=0)
    trainer.rollout.release()
    base = AutoModelForCausalLM.from_pretrained(info.base_dir, dtype=torch.float32)
    with_adapters = PeftModel.from_pretrained(base, str(out_dir)).eval()
    worst, worst_base = 0.0, 0.0
    with torch.no_grad():
        for r in greedy + sampled:
            ids = torch.tensor([prompts[r.prompt_index] + r.token_ids])
            start = len(prompts[r.prompt_index]) - 1
            for model, which in ((with_adapters, "lora"), (None, "base")):
                if model is None:
                    with with_adapters.disable_adapter():
                        logits = with_adapters(ids).logits[0, start:-1]
                else:
                    logits = model(ids).logits[0, start:-1]
                ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
                err = (ref - torch.tensor(r.log_probs)).abs().max().item()
                if which == "lora":
                    worst = max(worst, err)
                else:
                    worst_base = max(worst_base, err)
    return {"log_prob_error_vs_peft": worst, "log_prob_error_vs_base": worst_base, "responses": len(greedy + sampled),
            "sync_bytes": stats.bytes, "sync_buckets": stats.buckets}


def spy(trainer, events: list) -> dict:
    """Record SGLang's calls on this rank's engine, the trainer-state offload and the updates, in order; and the
    rollout vs actor token-probability difference of every update's batch."""
    engine = trainer.rollout.engine._engine  # the sglang.Engine (this rank drives its engine: TP 1)
    for name in ("begin_weight_update", "end_weight_update", "flush_cache", "generate", "release_memory_occupation",
                 "resume_memory_occupation", "load_lora_adapter_from_tensors", "unload_lora_adapter"):
        wrap(engine, name, lambda name, args, kwargs: events.append(
            name if "tags" not in kwargs else f"{name}({','.join(kwargs['tags'])})"))
    wrap(engine, "update_weights_from_tensor", lambda *_: events.append("update_weights_from_tensor"))
    for name in ("offload", "reload"):
        wrap(trainer.trainer_state, name, lambda name, *_: events.append(f"trainer_state.{name}"))
    diffs: list[float] = []

    routes_in_batch: list[bool] = []

    tool_rows: list[dict] = []

    def record_update(name, args, kwargs):
        batch = args[0]
        routes_in_batch.append("routed_experts" in batch)
        mask = batch["response_mask"].bool()
        diff = (batch["old_log_probs"].exp() - batch["rollout_log_probs"].exp()).abs()[mask]
        diffs.append(float(diff.max()))
        if "num_tool_calls" in batch:
            tool_rows.extend(multi_turn_rows(batch))
        events.append("actor.update")

    wrap(trainer.actor, "update", record_update)
    wrap(trainer.actor, "compute_log_prob", lambda *_: events.append("actor.compute_log_prob"))
    if trainer.critic is not None:
        wrap(trainer.critic, "update", lambda *_: events.append("critic.update"))
    return {"rollout_probs_diff_max": diffs, "routes_in_batch": routes_in_batch, "tool_rows": tool_rows}


def multi_turn_rows(batch: dict) -> list[dict]:
    """This rank's rows of a multi-turn update batch, unpadded: the prompt, the response (tool turns included), its
    loss mask, the engine's and the actor's log-probs, the tool calls."""
    prompt_width = batch["prompt_mask"].shape[1]
    rows = []
    for r in range(batch["responses"].shape[0]):
        length = int(batch["attention_mask"][r, prompt_width:].sum())
        rows.append({"prompt": batch["input_ids"][r, :prompt_width][batch["prompt_mask"][r].bool()].tolist(),
                     "response": batch["responses"][r, :length].tolist(),
                     "mask": batch["response_mask"][r, :length].int().tolist(),
                     "rollout_log_probs": batch["rollout_log_probs"][r, :length].tolist(),
                     "old_log_probs": batch["old_log_probs"][r, :length].tolist(),
                     "num_tool_calls": int(batch["num_tool_calls"][r])})
    return rows


def wrap(obj, name: str, before) -> None:
    original = getattr(obj, name)

    def wrapped(*args, **kwargs):
        before(name, args, kwargs)
        return original(*args, **kwargs)

    setattr(obj, name, wrapped)


def offload_round_trip(trainer) -> dict:
    """The trainer's offload mechanics on the CPU, forced on: storage freed, then the parameters and optimizer
    state bitwise back and the gradient buffers zeroed (every update zeroes them before use anyway)."""
    from mppo.workers.offload import _buffers, _optimizer_tensors

    state = trainer.trainer_state
    kept = [t for chunk in trainer.actor.model for t in chunk.parameters()]
    kept += [b.param_data for b in _buffers(trainer.actor.model) if b.param_data is not None]
    kept += list(_optimizer_tensors(trainer.actor.optimizer))
    grads = [b.grad_data for b in _buffers(trainer.actor.model)]
    before = [t.detach().clone() for t in kept]
    state.offload()
    freed = [p.device_bytes() for p in state._params]
    state.reload()
    optimizer_tensors = len(list(_optimizer_tensors(trainer.actor.optimizer)))
    return {"device_bytes_offloaded": freed, "optimizer_tensors": optimizer_tensors,
            "bitwise_back": all(torch.equal(a, b.detach()) for a, b in zip(before, kept)),
            "grads_zero": all(bool((g == 0).all()) for g in grads) and len(grads) > 0}


def moe_check(trainer, out_dir: Path) -> dict:
    """Sync the trained weights, generate, and compare with HF transformers loading what the exporter streams."""
    from transformers import AutoModelForCausalLM

    import safetensors.torch
    from hf_reference import hf_router_top_k, hf_token_log_probs, route_disagreements

    from mppo.models.weights import iter_hf_weights
    from mppo.rollout import SamplingParams

    eos = tuple(trainer.train_sampling.stop_token_ids)
    prompts = prompt_ids(trainer)
    trainer.sync_weights()
    responses = trainer.rollout.generate(prompts, SamplingParams(do_sample=False, max_new_tokens=12,
                                                                 stop_token_ids=eos), step=0)
    responses += trainer.rollout.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12,
                                                                  stop_token_ids=eos, seed=3), step=0)
    trainer.rollout.release()
    exported = {name: t.detach().clone().contiguous() for name, t in iter_hf_weights(
        trainer.actor.model, trainer.actor.hf_args, destinations=trainer.rollout.layout.destinations)}
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = Path(trainer.cfg.actor_rollout_ref.model.path)
    (out_dir / "config.json").write_text((model_path / "config.json").read_text())
    safetensors.torch.save_file(exported, str(out_dir / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    log_prob_error, routes = 0.0, {"rows": 0, "different": 0, "different_not_tie": 0, "shape_equal": True}
    for r in responses:
        prompt = prompts[r.prompt_index]
        ref = hf_token_log_probs(hf, prompt, r.token_ids)
        log_prob_error = max(log_prob_error, (ref - torch.tensor(r.log_probs)).abs().max().item())
        one = route_disagreements(r.routed_experts, *hf_router_top_k(hf, prompt, r.token_ids))
        routes = {k: (routes[k] and one[k]) if k == "shape_equal" else routes[k] + one[k] for k in routes}
    expert_tensors = sum(".mlp.experts." in name for name in exported)
    return {"log_prob_error": log_prob_error, "routes": routes, "responses": len(responses),
            "exported_expert_tensors": expert_tensors}


def after_fit_checks(trainer, cfg, case: dict, out: Path, name: str) -> None:
    """What each kind of case checks once its fit() is done."""
    from mppo.config.lora import adapter_sync

    if cfg.actor_rollout_ref.rollout.multi_turn.enable:  # its checks are on the recorded rows
        return
    if cfg.actor_rollout_ref.actor.router_replay.mode == "R3":
        case["ep"] = trainer.dims.ep
        case["moe"] = moe_check(trainer, out / f"{name}_export_rank{os.environ['RANK']}")
    elif adapter_sync(cfg):
        case["weights"] = base_vs_exporter(trainer)
        case["adapters"] = adapter_check(trainer, out / f"{name}_adapter")
    else:
        case["weights"] = weights_vs_exporter(trainer)
        if cfg.actor_rollout_ref.model.lora.rank > 0:
            case["lora_delta"] = merged_vs_base(trainer, Path(cfg.actor_rollout_ref.model.path))
        if trainer.trainer_state.roles:
            case["offload"] = offload_round_trip(trainer)


def run(args, result: dict) -> None:
    logging.basicConfig(level=logging.WARNING)
    from mppo.config.lora import adapter_sync
    from mppo.parallel import destroy, init_distributed
    from mppo.rollout import SamplingParams
    from mppo.rollout.factory import build_rollout
    from mppo.trainer.fit import PPOTrainer

    cases = json.loads(args.cases)
    rollout, served = None, None  # the engines of the current model config
    for name, overrides in cases.items():
        began = time.monotonic()
        cfg = load(args.config, overrides)
        # an engine serves any weights of its model's config (the trainer pushes them before every generation)
        config = (Path(cfg.actor_rollout_ref.model.path) / "config.json").read_text()
        config += f"lora adapters only: {adapter_sync(cfg)}"  # those engines start with SGLang's LoRA support
        if config != served:
            if rollout is not None:
                rollout.shutdown()
            init_distributed(1, 1)
            rollout = build_rollout(cfg, device=torch.device("cpu"), dtype=torch.float32,
                                    log_dir=args.out / f"sglang_{name}")
            destroy()
            served = config
            result.setdefault("engines", len(rollout.layout.groups))
            result.setdefault("group", list(rollout.layout.ranks))
        trainer = PPOTrainer(cfg, rollout=rollout)
        eos = tuple(trainer.train_sampling.stop_token_ids)
        case: dict = {"layout": {"tp": trainer.dims.tp, "dp": trainer.dims.dp}}
        result[name] = case
        if name.endswith("ppo"):
            case["greedy"] = rollout_once(trainer, SamplingParams(do_sample=False, max_new_tokens=12,
                                                                  stop_token_ids=eos))
            case["sampled_twice"] = [rollout_once(trainer, SamplingParams(temperature=1.0, max_new_tokens=12,
                                                                          stop_token_ids=eos, seed=7))
                                     for _ in range(2)]
        if trainer.trainer_state.roles:
            trainer.trainer_state.active = True  # exercise the offload mechanics on the CPU (a no-op by default)
        events: list[str] = []
        case.update(spy(trainer, events))
        trainer.fit()
        case["events"] = list(events)
        after_fit_checks(trainer, cfg, case, args.out, name)
        close(trainer)
        case["wall_s"] = time.monotonic() - began  # what the case adds to the launch (CI budget)
    rollout.shutdown()


def main() -> None:
    def arguments(p):
        p.add_argument("--config", required=True)
        p.add_argument("--cases", required=True, help="JSON {name: overrides} of the trainers, run in this order")

    rank_main(run, add_arguments=arguments, process_group=False)


if __name__ == "__main__":
    main()
