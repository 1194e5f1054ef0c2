"""LoRA on Qwen3-MoE's experts, cases of tests/dist/models_moe.py's launch (at TP1, EP2 and TP2 x EP2 with
expert-TP 1): adapters on every projection, attention, the dense layer's MLP and each expert's, loaded from one set
of full PEFT-keyed tensors. References, independent of mppo's adapters: HF transformers with the adapters merged
into its weights by hand (W + alpha/r * B @ A; its experts are fused 3D parameters, so PEFT cannot adapt them) for
log-probs and the merged HF export, and HF autograd through that merge (torch.func.functional_call) for the
adapters' gradients.
"""
from __future__ import annotations

import torch

RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK
CHECKPOINT_SAVE, CHECKPOINT_LOAD = (1, 1, 2), (2, 1, 2, 1)  # EP2, then TP2 x EP2 with expert-TP 1


def spec():
    from mppo.config.lora import HF_PROJECTIONS
    from mppo.models.lora import LoRASpec

    return LoRASpec(rank=RANK, alpha=ALPHA, dropout=0.0, projections=HF_PROJECTIONS, seed=3)


def adapter_tensors(args, seed: int = 31) -> dict[str, torch.Tensor]:
    """Full PEFT-keyed tensors, B != 0: attention and MLP projections of every layer, per expert on MoE layers."""
    from mppo.models.lora import projection_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(args.num_layers):
        modules = [("self_attn", p, False) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        mlp = ([(f"mlp.experts.{e}", p, True) for e in range(args.num_experts) for p in ("gate_proj", "up_proj",
                                                                                          "down_proj")]
               if layer in args.moe_layers else [("mlp", p, False) for p in ("gate_proj", "up_proj", "down_proj")])
        for module, proj, expert in modules + mlp:
            o, i = projection_shapes(args, expert=expert)[proj]
            prefix = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, i, generator=g) * 0.2
            out[f"{prefix}.lora_B.weight"] = torch.randn(o, RANK, generator=g) * 0.2
    return out


def merged_hf_state(hf, tensors) -> dict[str, torch.Tensor]:
    """HF's parameters with the adapters merged by hand (differentiable in `tensors`): a per-projection weight
    gets s * B @ A; a fused expert tensor (gate_up_proj [E, 2I, H] = [gate; up] per expert, down_proj [E, H, I])
    gets each expert's deltas in its slice."""
    state = dict(hf.named_parameters())
    deltas: dict[str, dict] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        deltas[module] = SCALE * b @ a
    merged = {}
    for name, param in state.items():
        base = name.removesuffix(".weight")
        if base in deltas:
            merged[name] = param + deltas[base]
        elif name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            per_expert = []
            for e in range(param.shape[0]):
                if name.endswith("down_proj"):
                    per_expert.append(param[e] + deltas[f"{prefix}.{e}.down_proj"])
                else:
                    per_expert.append(param[e] + torch.cat([deltas[f"{prefix}.{e}.gate_proj"],
                                                            deltas[f"{prefix}.{e}.up_proj"]]))
            merged[name] = torch.stack(per_expert)
        else:
            merged[name] = param
    return merged


def hf_log_prob_sum(hf, params, batches, temperature):
    total = 0.0
    for mb in batches:
        ids = mb["input_ids"]
        logits = torch.func.functional_call(hf, params, (ids,)).logits.float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        total = total + logp[:, :-1].gather(-1, ids[:, 1:, None]).sum()
    return total


def hf_merged_reference(hf, tensors, batches, hf_reference):
    """(log-prob refs of HF with the adapters merged, the merged state, d(sum log-probs)/d(adapter tensors))."""
    from models_parallel import TEMPERATURE

    import copy

    with torch.no_grad():
        merged = {k: v.detach().clone() for k, v in merged_hf_state(hf, tensors).items()}
    reference = copy.deepcopy(hf).eval()
    reference.load_state_dict(merged, strict=False)
    refs = hf_reference(reference, batches)
    leaves = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    hf.requires_grad_(False)
    hf_log_prob_sum(hf, merged_hf_state(hf, leaves), batches, TEMPERATURE).backward()
    return refs, merged, {k: v.grad for k, v in leaves.items()}, tensors


def lora_moe_cases(work, res, key, layout, args, dims, batches, reference, base_log_probs) -> None:
    """At one layout: the LoRA model's log-probs vs HF merged, B = 0 vs the base bitwise, the gathered PEFT tensors
    vs the loaded ones, the merged HF export vs the merge by hand, (TP1 layouts) the adapters' gradients, and a
    dist checkpoint of the adapters written at EP2 and read at TP2 x EP2."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from models_parallel import TEMPERATURE, max_diff
    from next_token import next_token_loss_step, token_logprobs
    from mppo.models.builders import build_gpt_model
    from mppo.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from mppo.models.lora import apply_lora, iter_adapters
    from mppo.models.lora_io import gather_peft_tensors, load_peft_tensors
    from mppo.models.weights import iter_hf_weights, load_hf_weights
    from mppo.workers.pipeline import run_pipeline

    refs, merged, hf_grads, tensors = reference
    tp = layout[0]
    chunks = build_gpt_model(args, dims, role="actor")
    load_hf_weights(chunks, work / "qwen3_moe", args)
    apply_lora(chunks, args, spec())
    if tp > 1:  # megatron trains MoE layers under TP only with sequence parallelism: the log-prob pass is eval
        for chunk in chunks:
            chunk.eval()
    experts = [a for a in iter_adapters(chunks) if a.expert]
    res[f"{key}/lora_moe/expert_adapters"] = sorted({a.hf_prefix.split(".mlp.")[1] for a in experts})
    res[f"{key}/lora_moe/expert_adapters_not_allreduced"] = all(
        getattr(p, "allreduce", True) is (ps.get_expert_model_parallel_world_size() == 1)
        for a in experts for p in (*a.lora_A.values(), *a.lora_B.values()))
    lp = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
    res[f"{key}/lora_moe/b0_equals_base"] = all(torch.equal(a["log_probs"], b["log_probs"])
                                                for a, b in zip(lp, base_log_probs))
    if layout == CHECKPOINT_LOAD:  # the dist checkpoint written at CHECKPOINT_SAVE: experts over other EP ranks
        load_model_checkpoint(chunks, work / "lora_moe_ckpt")
        loaded = gather_peft_tensors(chunks)
        res[f"{key}/lora_moe/checkpoint_from_ep2_equal"] = sorted(loaded) == sorted(tensors) and all(
            torch.equal(loaded[k], tensors[k]) for k in tensors)
    load_peft_tensors(chunks, tensors)
    lp = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
    res[f"{key}/lora_moe/log_probs_vs_hf_merged"] = max_diff(lp, refs, "log_probs")
    res[f"{key}/lora_moe/log_probs_vs_base"] = max_diff(lp, base_log_probs, "log_probs")  # the adapters act
    if layout == CHECKPOINT_SAVE:
        save_model_checkpoint(chunks, work / "lora_moe_ckpt", args)
    gathered = gather_peft_tensors(chunks)
    res[f"{key}/lora_moe/gathered_equal"] = sorted(gathered) == sorted(tensors) and all(
        torch.equal(gathered[k], tensors[k]) for k in tensors)
    exported = dict(iter_hf_weights(chunks, args))
    per_expert = {}
    for name, value in merged.items():  # the hand merge, under the checkpoint's per-expert names
        if name.endswith("mlp.experts.gate_up_proj"):
            half = value.shape[1] // 2
            prefix = name.rsplit(".", 1)[0]
            for e in range(value.shape[0]):
                per_expert[f"{prefix}.{e}.gate_proj.weight"] = value[e, :half]
                per_expert[f"{prefix}.{e}.up_proj.weight"] = value[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            for e in range(value.shape[0]):
                per_expert[f"{prefix}.{e}.down_proj.weight"] = value[e]
        else:
            per_expert[name] = value
    res[f"{key}/lora_moe/export_names_equal"] = sorted(exported) == sorted(per_expert)
    res[f"{key}/lora_moe/export_vs_hand_merge"] = max(
        (exported[k].float() - per_expert[k].float()).abs().max().item() for k in exported if k in per_expert)
    if tp == 1:
        inputs, step = next_token_loss_step(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
        for c in chunks:
            c.zero_grad(set_to_none=True)
        run_pipeline(chunks, inputs, step, forward_only=False)
        params = [p for a in iter_adapters(chunks) for p in (*a.lora_A.values(), *a.lora_B.values())]
        saved = [p.data for p in params]
        for p in params:
            p.data = p.grad
        try:
            got = gather_peft_tensors(chunks)
        finally:
            for p, data in zip(params, saved):
                p.data = data
        # every rank runs the same micro-batches: an expert receives the tokens of all EP ranks, so its adapters'
        # gradients are EP x HF's (DDP's 1/DP scaling makes that the batch mean), the others' HF's
        ep = ps.get_expert_model_parallel_world_size()
        res[f"{key}/lora_moe/grad_rel"] = max(
            (got[k] - hf_grads[k] * (ep if ".mlp.experts." in k else 1)).abs().max().item()
            / hf_grads[k].abs().max().item() for k in hf_grads)
    dist.barrier()
