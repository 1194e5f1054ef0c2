"""LoRA cases of tests/dist/models_parallel.py's launch (one model, every layout it runs): adapters loaded from the
same full PEFT tensors at each layout vs HF + those tensors as a PEFT adapter (tests/peft_reference.py), vs TP1,
B = 0 and disabled adapters vs the base bitwise, the gathered PEFT tensors and the merged HF export, and the
adapters' gradients vs HF autograd (with sequence parallelism at TP2 as well).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from peft_reference import random_adapter_tensors, with_adapter

MODEL = "qwen2_untied"
RANK, ALPHA = 4, 8.0
TEMPERATURE = 0.7


def spec():
    from mppo.config.lora import HF_PROJECTIONS
    from mppo.models.lora import LoRASpec

    return LoRASpec(rank=RANK, alpha=ALPHA, dropout=0.0, projections=HF_PROJECTIONS, seed=3)


def adapter_tensors(args) -> dict[str, torch.Tensor]:
    from mppo.models.lora import projection_shapes

    return random_adapter_tensors(projection_shapes(args), args.num_layers, spec().projections, RANK, seed=11)


def write_reference_adapter(out: Path, tensors) -> None:
    """A PEFT adapter directory written with safetensors + json only (the reference's input, not mppo's writer)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0, "bias": "none",
         "target_modules": list(spec().projections), "task_type": "CAUSAL_LM"}))


def hf_lora_reference(work: Path, tensors, batches, hf_reference, load_hf_model):
    """(refs, HF+PEFT model) with `tensors` as the adapter (rank 0 writes the directory first)."""
    adapter_dir = work / "lora_reference_adapter"
    if dist.get_rank() == 0:
        write_reference_adapter(adapter_dir, tensors)
    dist.barrier()
    model = with_adapter(load_hf_model(work / MODEL), adapter_dir)
    return hf_reference(model, batches), model


def _lora_model(work, args, dims, *, sequence_parallel: bool):
    from mppo.models.builders import build_gpt_model
    from mppo.models.lora import apply_lora
    from mppo.models.weights import load_hf_weights

    chunks = build_gpt_model(args, dims, role="actor", sequence_parallel=sequence_parallel)
    load_hf_weights(chunks, work / MODEL, args)
    apply_lora(chunks, args, spec())
    return chunks


def _adapter_grads(chunks) -> dict[str, torch.Tensor]:
    """The adapters' gradients as full PEFT tensors (through gather_peft_tensors, on the grads)."""
    from mppo.models.lora import iter_adapters
    from mppo.models.lora_io import gather_peft_tensors

    params = [p for a in iter_adapters(chunks) for p in (*a.lora_A.values(), *a.lora_B.values())]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.grad if p.grad is not None else torch.zeros_like(p)
    try:
        return gather_peft_tensors(chunks)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def hf_adapter_grads(work, tensors, batches, load_hf_model) -> dict[str, torch.Tensor]:
    """d(sum log-probs + 0.1 sum entropy)/d(adapter tensors) of HF with the adapter applied by hand."""
    leaves = {k: v.clone().requires_grad_(True) for k, v in tensors.items()}
    hf = load_hf_model(work / MODEL)
    hf.requires_grad_(False)
    for key, a in leaves.items():
        if key.endswith(".lora_A.weight"):
            b = leaves[key.replace(".lora_A.", ".lora_B.")]
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            hf.get_submodule(module).register_forward_hook(
                lambda _, i, o, a=a, b=b: o + torch.nn.functional.linear(torch.nn.functional.linear(i[0], a), b)
                * (ALPHA / RANK))
    total = 0.0
    for mb in batches:
        ids = mb["input_ids"]
        logp = torch.log_softmax(hf(ids).logits.float() / TEMPERATURE, dim=-1)
        total = total + logp[:, :-1].gather(-1, ids[:, 1:, None]).sum() \
            + 0.1 * (-(logp.exp() * logp).sum(-1)[:, :-1]).sum()
    total.backward()
    return {k: v.grad for k, v in leaves.items()}


def _grad_diff(chunks, args, batches, hf_grads, *, sequence_parallel: bool) -> float:
    from megatron.core import parallel_state as ps

    from next_token import next_token_loss_step
    from mppo.workers.pipeline import run_pipeline

    inputs, step = next_token_loss_step(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE,
                                        entropy_coeff=0.1)
    for c in chunks:
        c.zero_grad(set_to_none=True)
    run_pipeline(chunks, inputs, step, forward_only=False)
    if sequence_parallel:  # what megatron's finalize_model_grads does for `sequence_parallel` params (no DDP here)
        for c in chunks:
            for p in c.parameters():
                if getattr(p, "sequence_parallel", False) and p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    got = _adapter_grads(chunks)
    return max((got[k] - hf_grads[k]).abs().max().item() / hf_grads[k].abs().max().item() for k in hf_grads)


def lora_layout_cases(work, res, key, tp, args, dims, batches, base_logits, lora_refs, tensors, hf_grads,
                      lora_outputs) -> None:
    """Every LoRA case at this layout; `lora_outputs[key]` keeps the log-probs for the TP1 comparison."""
    from models_parallel import max_diff
    from next_token import token_logits, token_logprobs
    from mppo.models.lora import adapters_disabled, has_adapters
    from mppo.models.lora_io import gather_peft_tensors, load_peft_tensors
    from mppo.models.weights import iter_hf_weights

    chunks = _lora_model(work, args, dims, sequence_parallel=False)
    res[f"{key}/lora/base_frozen"] = has_adapters(chunks) and all(
        p.requires_grad == (".lora.lora_" in n) for c in chunks for n, p in c.named_parameters())
    res[f"{key}/lora/b0_bitwise"] = all(
        torch.equal(a["logits"], b["logits"]) for a, b in zip(token_logits(chunks, batches, args.vocab_size),
                                                                base_logits))
    load_peft_tensors(chunks, tensors)
    lp = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
    lora_outputs[key] = lp
    res[f"{key}/lora/log_probs_vs_peft"] = max_diff(lp, lora_refs, "log_probs")
    res[f"{key}/lora/logits_vs_peft"] = max_diff(token_logits(chunks, batches, args.vocab_size), lora_refs, "logits")
    res[f"{key}/lora/effect"] = max_diff(base_logits, lora_refs, "logits")  # the adapters must matter
    with adapters_disabled(chunks):
        res[f"{key}/lora/disabled_bitwise"] = all(
            torch.equal(a["logits"], b["logits"]) for a, b in zip(token_logits(chunks, batches, args.vocab_size),
                                                                    base_logits))
    gathered = gather_peft_tensors(chunks)
    res[f"{key}/lora/gather_bitwise"] = sorted(gathered) == sorted(tensors) and all(
        torch.equal(gathered[k], tensors[k]) for k in tensors)
    merged, worst = dict(iter_hf_weights(chunks, args)), 0.0
    base = {n: t for n, t in merged.items()}  # names; values checked against a by-hand merge below
    from safetensors.torch import load_file

    originals = load_file(str(work / MODEL / "model.safetensors"))
    for name, tensor in base.items():
        expect = originals[name].clone()
        a_key = f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight"
        if name.endswith(".weight") and a_key in tensors:
            expect = expect + tensors[a_key.replace(".lora_A.", ".lora_B.")] @ tensors[a_key] * (ALPHA / RANK)
        worst = max(worst, (tensor - expect).abs().max().item())
    res[f"{key}/lora/merged_export_vs_by_hand"] = worst
    res[f"{key}/lora/merged_export_names"] = sorted(merged) == sorted(originals)
    res[f"{key}/lora/grad_vs_hf"] = _grad_diff(chunks, args, batches, hf_grads, sequence_parallel=False)
    if tp > 1:  # sequence parallelism (the workers' default at TP > 1): the adapters' SP collectives
        sp = _lora_model(work, args, dims, sequence_parallel=True)
        load_peft_tensors(sp, tensors)
        res[f"{key}/lora/sp_log_probs_vs_peft"] = max_diff(
            token_logprobs(sp, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE), lora_refs, "log_probs")
        res[f"{key}/lora/sp_grad_vs_hf"] = _grad_diff(sp, args, batches, hf_grads, sequence_parallel=True)
