"""LoRA cases of tests/dist/workers_parallel.py's launch: the actor's PPO update (two optimizer steps, KL loss,
clipping) with LoRA at TP2 (sequence parallelism on: the default) equals TP1 (metrics, adapters); the frozen base is
bitwise unchanged; only adapter parameters are in megatron DDP's grad buffers; the reference built on the LoRA actor
is the base (bitwise the log-probs of an actor without LoRA); a checkpoint holds the adapters and their optimizer
state only and resumes bit-identically, and one made on another base is refused.
"""
from __future__ import annotations

import torch

LORA = dict(rank=4, alpha=8.0, target_modules=["all-linear"])


def _model_cfg():
    from mppo.config.schema import LoRAConfig, ModelConfig

    return ModelConfig(lora=LoRAConfig(**LORA))


def _base_state(actor) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(actor.model) for n, p in c.named_parameters()
            if ".lora.lora_" not in n}


def lora_cases(cases, actor_config, temperature: float, dp_shard) -> None:
    from mppo.config.schema import RefConfig
    from mppo.models.lora_io import gather_peft_tensors
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.actor import ActorWorker
    from mppo.workers.reference import ReferenceWorker
    from mppo.workers.worker_checkpoint import CheckpointMismatchError, load_worker_checkpoint, \
        save_worker_checkpoint

    res, full = cases.res, cases.batch
    results = {}
    for tp, pp in ((2, 1), (1, 1), (2, 2)):
        key = f"lora/tp{tp}pp{pp}"
        dims = init_distributed(tp, pp, seed=1234)
        shard = dp_shard(full, dims.dp, dims.dp_rank)
        actor = ActorWorker(_model_cfg(), actor_config(tp, pp, None), dims, cases.work / "actor", total_steps=4)
        trainable = {id(p) for c in actor.model for n, p in c.named_parameters() if ".lora.lora_" in n}
        in_buffers = {id(p) for c in actor.model for p in c.params_with_grad}
        res[f"{key}/only_adapters_in_ddp"] = bool(trainable) and in_buffers == trainable
        before = _base_state(actor)
        lp0 = actor.compute_log_prob(shard, temperature=temperature)
        metrics = actor.update(shard, temperature=temperature)
        after = _base_state(actor)
        res[f"{key}/base_bitwise_unchanged"] = sorted(before) == sorted(after) and all(
            torch.equal(before[k], after[k]) for k in before)
        adapters = gather_peft_tensors(actor.model)
        lp1 = actor.compute_log_prob(shard, temperature=temperature)
        res[f"{key}/update_moved_log_probs"] = (lp1 - lp0).abs().max().item()
        ref = ReferenceWorker(_model_cfg(), RefConfig(log_prob_micro_batch_size_per_gpu=2), dims,
                              cases.work / "actor", logprob_impl="fused", kernel_backend="torch", lora_actor=actor)
        ref_lp = ref.compute_log_prob(shard, temperature=temperature)  # its own micro-batches: not bitwise
        res[f"{key}/ref_vs_start"] = (ref_lp - lp0).abs().max().item()
        res[f"{key}/ref_vs_updated"] = (ref_lp - lp1).abs().max().item()
        results[key] = (metrics, adapters, lp1, dims.dp_rank, dims.dp)
        if (tp, pp) == (2, 1):
            path = cases.work / "lora_ckpt"
            save_worker_checkpoint(actor, path)
            saved_lp = actor.compute_log_prob(full, temperature=temperature)  # every row, on every rank
            from megatron.core.dist_checkpointing import load_tensors_metadata

            saved = list(load_tensors_metadata(str(path / "model")))
            res[f"{key}/ckpt_adapter_keys"] = sum(".lora.lora_" in k for k in saved)
            res[f"{key}/ckpt_base_keys"] = [k for k in saved if ".lora.lora_" not in k and
                                            not k.startswith("optimizer.")]
            res[f"{key}/ckpt_lora_meta"] = (path / "lora.json").is_file()
            m2 = actor.update(shard, temperature=temperature)
            again = ActorWorker(_model_cfg(), actor_config(tp, pp, None), dims, cases.work / "actor", total_steps=4)
            load_worker_checkpoint(again, path)
            res[f"{key}/resume_metrics_same"] = again.update(shard, temperature=temperature) == m2
            res[f"{key}/resume_adapters_bitwise"] = all(
                torch.equal(a, b) for a, b in zip(gather_peft_tensors(again.model).values(),
                                                  gather_peft_tensors(actor.model).values()))
            other = ActorWorker(_model_cfg(), actor_config(tp, pp, None), dims, cases.work / "lora_other_base",
                                total_steps=4)
            try:
                load_worker_checkpoint(other, path)
                res[f"{key}/other_base_error"] = "no error"
            except CheckpointMismatchError as err:
                res[f"{key}/other_base_error"] = str(err)
        destroy()
    convert_cases(cases, temperature, saved_lp)
    tp1 = results["lora/tp1pp1"]
    for key, (metrics, adapters, lp, dp_rank, dp) in results.items():
        res[f"{key}/metrics_vs_tp1"] = max(abs(metrics[k] - tp1[0][k]) for k in tp1[0])
        res[f"{key}/adapters_vs_tp1"] = max((adapters[k] - tp1[1][k]).abs().max().item() for k in tp1[1])
        res[f"{key}/adapter_change"] = max(adapters[k].abs().max().item() for k in adapters if "lora_B" in k)


def convert_cases(cases, temperature: float, saved_lp: torch.Tensor) -> None:
    """`mppo convert mcore-to-hf` of the TP2 LoRA checkpoint (at TP1 x PP2 here): a PEFT adapter directory that HF
    + the adapter (tests/peft_reference.py) scores like the actor did, and with --merge an HF model that does."""
    from models_fixtures import load_hf_model
    from peft_reference import HAVE_PEFT, with_adapter
    from workers_fixtures import hf_response_logprobs
    from mppo.models import convert

    res, work, mask = cases.res, cases.work, cases.batch["response_mask"].bool()
    ckpt, peft_dir, merged = work / "lora_ckpt", work / "lora_peft", work / "lora_merged"
    res["lora/convert/peft_rc"] = convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(peft_dir),
                                                "--pp", "2"])
    res["lora/convert/merged_rc"] = convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(merged),
                                                  "--merge"])
    res["lora/convert/other_base_rc"] = convert.main(["mcore-to-hf", "--ckpt", str(ckpt), "--out",
                                                      str(work / "lora_bad"), "--base",
                                                      str(work / "lora_other_base")])
    res["lora/convert/with_peft_package"] = HAVE_PEFT
    res["lora/convert/peft_files"] = sorted(p.name for p in peft_dir.iterdir())
    with torch.no_grad():
        lp_peft = hf_response_logprobs(with_adapter(load_hf_model(work / "actor"), peft_dir), cases.batch,
                                       temperature)[0]
        lp_merged = hf_response_logprobs(load_hf_model(merged), cases.batch, temperature)[0]
        lp_base = hf_response_logprobs(load_hf_model(work / "actor"), cases.batch, temperature)[0]
    res["lora/convert/peft_vs_actor"] = (lp_peft - saved_lp)[mask].abs().max().item()
    res["lora/convert/merged_vs_actor"] = (lp_merged - saved_lp)[mask].abs().max().item()
    res["lora/convert/base_vs_actor"] = (lp_base - saved_lp)[mask].abs().max().item()  # the adapters matter
