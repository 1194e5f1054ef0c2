"""torchrun script (4 CPU ranks, gloo): Qwen3 dense and Qwen3-MoE as megatron models vs HF transformers, at TP1,
TP2, PP2, EP2, TP2 x EP2, EP2 x PP2 and EP4; HF -> megatron -> HF bitwise with experts on several EP ranks (every
rank a destination, and one destination through both transports); `mppo convert --ep` and an EP2 x PP2 dist
checkpoint loaded at EP1; gradients through the MoE layers vs HF autograd, also at TP2 x EP2 with sequence
parallelism (training mode: megatron's MoE layers train under TP only with it).

One launch runs every case and writes out/rank{R}.json; tests/test_models_moe.py asserts on them. References are
independent of the code under test: HF transformers' forward and autograd, the original safetensors files.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import QWEN3_MODELS, load_hf_model, make_hf_model, save_tiny_tokenizer  # noqa: E402
from models_parallel import (TEMPERATURE, compare_hf_dirs, hf_reference, max_diff, micro_batches,  # noqa: E402
                             run_logits)
from next_token import next_token_loss_step, token_logprobs  # noqa: E402

# (tp, pp, ep) on 4 ranks; EP is taken from the data-parallel ranks. (tp, pp, ep, etp): expert-TP other than TP,
# here whole experts split over the two TP ranks (EP over TP) while attention is TP-sharded
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (1, 2, 2), (1, 1, 4), (2, 1, 2, 1)]
EXPORT_LAYOUTS = [(1, 2, 2), (2, 1, 2), (2, 1, 2, 1)]
DENSE_LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1)]
UNNORMED_LAYOUTS = [(1, 1, 1), (1, 1, 2)]
LORA_LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 2, 1)]  # LoRA on the experts: whole experts (expert-TP 1)


def layout_name(tp: int, pp: int, ep: int, etp: int | None = None) -> str:
    return f"tp{tp}pp{pp}ep{ep}" + (f"etp{etp}" if etp is not None else "")


def models_for(layout) -> list[str]:
    names = ["qwen3_moe"]
    if layout in DENSE_LAYOUTS:
        names.append("qwen3_tied")
    if layout in UNNORMED_LAYOUTS:
        names.append("qwen3_moe_unnormed")
    return names


def moe_grad_diff(chunks, batches, args, hf) -> float:
    """Relative error of d(sum of log-probs)/d(router weight, expert 3's down projection) of the first MoE layer on
    this rank against HF autograd: the gradient through the router and the all-to-all dispatch."""
    from mppo.workers.pipeline import run_pipeline

    inputs, step = next_token_loss_step(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
    for c in chunks:
        c.zero_grad(set_to_none=True)
    run_pipeline(chunks, inputs, step, forward_only=False)
    hf.zero_grad(set_to_none=True)
    total = 0.0
    for mb in batches:
        ids = mb["input_ids"]
        logp = torch.log_softmax(hf(ids).logits.float() / TEMPERATURE, dim=-1)
        total = total + logp[:, :-1].gather(-1, ids[:, 1:, None]).sum()
    total.backward()

    diffs = [0.0]
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            if not hasattr(layer.mlp, "router"):
                continue
            hf_layer = hf.model.layers[layer.layer_number - 1].mlp
            got, ref = layer.mlp.router.weight.grad, hf_layer.gate.weight.grad
            if layer.config.sequence_parallel:  # each TP rank routed its slice of the sequence: a partial sum,
                # which megatron's finalize_model_grads all-reduces over TP (the router weight is marked for it)
                from megatron.core import parallel_state as ps
                assert getattr(layer.mlp.router.weight, "sequence_parallel", False)
                got = got.clone()
                dist.all_reduce(got, group=ps.get_tensor_model_parallel_group())
            diffs.append(((got - ref).abs().max() / ref.abs().max()).item())
            experts = layer.mlp.local_expert_indices
            if 3 in experts:  # HF keeps the experts' weights as [experts, out, in]; TP splits down_proj's input
                got = layer.mlp.experts.local_experts[experts.index(3)].linear_fc2.weight.grad
                from megatron.core import parallel_state as ps
                tp, rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
                # Every rank runs the same micro-batches, and the expert receives the tokens of all EP ranks, which
                # hold TP / expert-TP different slices of the sequence (SP): its gradient is EP x expert-TP / TP x
                # HF's (DDP's 1/DP scaling of expert gradients turns that into the batch mean).
                copies = ps.get_expert_model_parallel_world_size() * tp // ps.get_tensor_model_parallel_world_size()
                ref = hf_layer.experts.down_proj.grad[3] * copies
                cols = ref.shape[1] // tp
                ref = ref[:, rank * cols:(rank + 1) * cols]
                diffs.append(((got - ref).abs().max() / ref.abs().max()).item())
            return max(diffs)
    return max(diffs)


def run_cases(work: Path, res: dict, rank: int) -> None:
    from mppo.models.builders import build_gpt_model
    from mppo.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import bucketed, iter_hf_weights, load_hf_weights
    from mppo.parallel import ParallelLayoutError, destroy, init_distributed
    from safetensors.torch import load_file

    if rank == 0:
        for i, name in enumerate(QWEN3_MODELS):
            make_hf_model(name, work / name, seed=10 + i)
        save_tiny_tokenizer(work / "qwen3_moe", QWEN3_MODELS["qwen3_moe"][1]["vocab_size"])
    dist.barrier()
    hf_models = {name: load_hf_model(work / name) for name in QWEN3_MODELS}
    margs = {name: read_hf_config(work / name) for name in QWEN3_MODELS}
    batches = {name: micro_batches(margs[name].vocab_size, seed=20 + i) for i, name in enumerate(QWEN3_MODELS)}
    refs = {name: hf_reference(hf_models[name], batches[name]) for name in QWEN3_MODELS}
    originals = {name: load_file(str(work / name / "model.safetensors")) for name in QWEN3_MODELS}

    # Layouts that do not fit stop before any group is made, naming ep.
    for tp, ep in ((1, 3), (2, 4)):
        try:
            init_distributed(tp, 1, ep=ep)
            res[f"bad_ep{ep}_tp{tp}"] = "no error"
            destroy()
        except ParallelLayoutError as err:
            res[f"bad_ep{ep}_tp{tp}"] = str(err)

    from lora_moe import adapter_tensors, hf_merged_reference, lora_moe_cases

    lora_reference = hf_merged_reference(load_hf_model(work / "qwen3_moe"), adapter_tensors(margs["qwen3_moe"]),
                                         batches["qwen3_moe"], hf_reference)
    tp1_logits: dict[str, list] = {}
    tp1_log_probs: dict[str, list] = {}
    for layout in LAYOUTS:
        tp, pp, ep, etp = (*layout, None)[:4]
        key = layout_name(*layout)
        dims = init_distributed(tp, pp, ep=ep, etp=etp, seed=1234)
        res[f"{key}/dims"] = [dims.tp_rank, dims.pp_rank, dims.dp_rank, dims.ep_rank, dims.dp, dims.expert_dp]
        for name in models_for(layout):
            args = margs[name]
            chunks = build_gpt_model(args, dims, role="actor")
            res[f"{key}/{name}/local_experts"] = sorted(
                {e for c in chunks for layer in c.decoder.layers if hasattr(layer.mlp, "local_expert_indices")
                 for e in layer.mlp.local_expert_indices})
            load_hf_weights(chunks, work / name, args)
            if tp > 1 and args.is_moe:  # megatron refuses MoE + TP in training mode without sequence parallelism
                for chunk in chunks:
                    chunk.eval()
            outs = run_logits(chunks, batches[name], args.vocab_size)
            res[f"{key}/{name}/logits"] = max_diff(outs, refs[name], "logits")
            if layout == (1, 1, 1):
                tp1_logits[name] = outs
            lp = token_logprobs(chunks, batches[name], vocab_size=args.vocab_size, temperature=TEMPERATURE)
            if layout == (1, 1, 1):
                tp1_log_probs[name] = lp
            res[f"{key}/{name}/log_probs_vs_tp1"] = max_diff(lp, tp1_log_probs[name], "log_probs")
            res[f"{key}/{name}/log_probs"] = max_diff(lp, refs[name], "log_probs")
            res[f"{key}/{name}/entropy"] = max_diff(lp, refs[name], "entropy")
            if name == "qwen3_moe" and layout in LORA_LAYOUTS:
                lora_moe_cases(work, res, key, layout, args, dims, batches[name], lora_reference, lp)
            if name == "qwen3_moe" and tp == 1:
                res[f"{key}/{name}/grad"] = moe_grad_diff(chunks, batches[name], args, hf_models[name])
            if name == "qwen3_moe" and tp > 1:  # megatron trains MoE layers under TP only with sequence parallelism
                sp_key = f"{key}sp/{name}"
                chunks = build_gpt_model(args, dims, role="actor", sequence_parallel=True)
                load_hf_weights(chunks, work / name, args)
                lp = token_logprobs(chunks, batches[name], vocab_size=args.vocab_size, temperature=TEMPERATURE)
                res[f"{sp_key}/log_probs"] = max_diff(lp, refs[name], "log_probs")
                res[f"{sp_key}/log_probs_vs_tp1"] = max_diff(lp, tp1_log_probs[name], "log_probs")
                res[f"{sp_key}/entropy"] = max_diff(lp, refs[name], "entropy")
                res[f"{sp_key}/grad"] = moe_grad_diff(chunks, batches[name], args, hf_models[name])

            if layout in EXPORT_LAYOUTS or (layout == (1, 2, 1) and name == "qwen3_tied"):
                exported = dict(iter_hf_weights(chunks, args))
                res[f"{key}/{name}/export_names_equal"] = sorted(exported) == sorted(originals[name])
                res[f"{key}/{name}/export_bitwise"] = all(
                    torch.equal(exported[k], originals[name][k]) and exported[k].dtype == originals[name][k].dtype
                    for k in originals[name] if k in exported)
                names = [n for b in bucketed(iter_hf_weights(chunks, args), bucket_bytes=40_000) for n, _ in b]
                res[f"{key}/{name}/bucket_order_same"] = names == list(exported)
            if layout in ((1, 2, 2), (2, 1, 2, 1)) and name == "qwen3_moe":
                destinations_cases(chunks, args, originals[name], res, key, rank)
            if layout == (1, 2, 2) and name == "qwen3_moe":
                save_model_checkpoint(chunks, work / "moe_ckpt_ep2pp2", args)
        destroy()

    # The EP2 x PP2 dist checkpoint at EP1 x PP1 (and at TP2 x EP2): the same logits as loading HF directly.
    for layout in ((1, 1, 1), (2, 1, 2), (2, 1, 2, 1)):
        key = layout_name(*layout)
        dims = init_distributed(layout[0], layout[1], ep=layout[2], etp=(*layout, None)[3], seed=1234)
        args = margs["qwen3_moe"]
        chunks = build_gpt_model(args, dims)
        load_model_checkpoint(chunks, work / "moe_ckpt_ep2pp2")
        if layout[0] > 1:
            for chunk in chunks:
                chunk.eval()
        outs = run_logits(chunks, batches["qwen3_moe"], args.vocab_size)
        res[f"ckpt_ep2pp2_at_{key}/logits"] = max_diff(outs, refs["qwen3_moe"], "logits")
        if layout == (1, 1, 1):
            res[f"ckpt_ep2pp2_at_{key}/identical_to_hf_load"] = all(
                torch.equal(a["logits"], b["logits"]) for a, b in zip(outs, tp1_logits["qwen3_moe"]))
        destroy()

    # A dense model cannot take ep > 1, and ep must divide the experts (4): one line each, before building.
    dims = init_distributed(1, 1, ep=4, seed=1)
    try:
        build_gpt_model(margs["qwen3_tied"], dims)
        res["dense_ep4_error"] = "no error"
    except ParallelLayoutError as err:
        res["dense_ep4_error"] = str(err)
    destroy()
    six = read_hf_config({**json.loads((work / "qwen3_moe" / "config.json").read_text()), "num_experts": 6})
    dims = init_distributed(1, 1, ep=4, seed=1)
    try:
        build_gpt_model(six, dims)
        res["experts6_ep4_error"] = "no error"
    except ParallelLayoutError as err:
        res["experts6_ep4_error"] = str(err)
    destroy()

    convert_cases(work, res, rank, batches, refs, tp1_logits)
    cpu_compat_cases(res, margs["qwen3_moe"])


# The CPU patches only MoE layers need; tests/dist/models_parallel.py probes the others.
MOE_CPU_PATCHES = ("cuda_streams", "backward_device_mode", "uneven_sequence_collectives", "splits_as_numpy",
                   "te_general_gemm")


def cpu_compat_cases(res, args) -> None:
    """Each MoE patch is still needed: without it the megatron call site it serves fails; with it, it works. The
    probes run at EP2 (collectives over each EP pair); a missing patch fails on every rank at the same call, before
    that call's collective, so no rank is left waiting."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from mppo.models.builders import build_gpt_model
    from mppo.parallel import cpu_compat, destroy, init_distributed

    dims = init_distributed(1, 1, ep=2, seed=5)
    seq_len = iter(range(20, 200))  # RotaryEmbedding.forward is lru-cached per length: use a new one each time

    def forward(model, backward: bool = False) -> None:
        n = next(seq_len)
        out = model(torch.arange(n)[None] % args.vocab_size, torch.arange(n)[None], None)
        if backward:
            out.float().sum().backward()

    def build_and_forward() -> None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None  # a class-level stream, made by the first dispatcher
        forward(build_gpt_model(args, dims)[0])

    model = build_gpt_model(args, dims)[0]

    def uneven_gather_and_reduce_scatter() -> None:  # what the MoE dispatcher does over TP, here over the EP pair
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import mappings

        group, sizes = ps.get_expert_model_parallel_group(), [1, 2]
        mine = torch.ones(sizes[group.rank()], 2)
        assert mappings._gather_along_first_dim(mine, group, output_split_sizes=sizes).shape == (3, 2)
        summed = mappings._reduce_scatter_along_first_dim(torch.ones(3, 2), group, input_split_sizes=sizes)
        assert torch.equal(summed, torch.full((sizes[group.rank()], 2), 2.0))

    probes = {
        "uneven_sequence_collectives": uneven_gather_and_reduce_scatter,
        "cuda_streams": build_and_forward,
        "backward_device_mode": lambda: forward(model, backward=True),
        "splits_as_numpy": lambda: forward(model),
        "te_general_gemm": lambda: forward(model),
    }
    for name in MOE_CPU_PATCHES:
        with cpu_compat.without(name):
            try:
                probes[name]()
                res[f"cpu_compat/{name}/without"] = "no error"
            except Exception as err:  # noqa: BLE001 - any failure shows the patch is needed
                res[f"cpu_compat/{name}/without"] = f"{type(err).__name__}: {err}"[:300]
        try:
            probes[name]()
            res[f"cpu_compat/{name}/with"] = "ok"
        except Exception as err:  # noqa: BLE001
            res[f"cpu_compat/{name}/with"] = f"{type(err).__name__}: {err}"[:300]
    res["cpu_compat/installed_after"] = cpu_compat.installed()
    destroy()


def destinations_cases(chunks, args, original, res, key, rank) -> None:
    """One destination (global rank 0) in each export group, through both transports: the full model arrives there,
    bitwise, and nowhere else."""
    from mppo.models.weights import iter_hf_weights

    for transport in ("collective", "shared_memory"):
        got = {n: t.clone() for n, t in iter_hf_weights(chunks, args, destinations=[0, 3], transport=transport)}
        if rank in (0, 3):
            ok = sorted(got) == sorted(original) and all(torch.equal(got[k], original[k]) for k in original)
        else:
            ok = not got
        res[f"{key}/destinations/{transport}"] = ok


def convert_cases(work, res, rank, batches, refs, tp1_logits) -> None:
    """`mppo convert` in-process: HF -> dist ckpt at TP2 x EP2 -> load at TP1 x EP1 -> HF, and -> HF at EP4."""
    from mppo.models import convert
    from mppo.models.builders import build_gpt_model
    from mppo.models.checkpoint import checkpoint_hf_dir, load_model_checkpoint
    from mppo.models.hf_config import read_hf_config
    from mppo.parallel import destroy, init_distributed

    name = "qwen3_moe"
    ckpt = work / "ckpt_moe_tp2ep2"
    res["convert/hf_to_mcore_rc"] = convert.main(
        ["hf-to-mcore", "--hf", str(work / name), "--out", str(ckpt), "--tp", "2", "--ep", "2"])
    res["convert/bad_ep_rc"] = convert.main(
        ["hf-to-mcore", "--hf", str(work / name), "--out", str(work / "never"), "--ep", "3"])
    dims = init_distributed(1, 1)
    args = read_hf_config(checkpoint_hf_dir(ckpt))
    chunks = build_gpt_model(args, dims)
    load_model_checkpoint(chunks, ckpt)
    outs = run_logits(chunks, batches[name], args.vocab_size)
    res["convert/ep1_logits_identical"] = all(
        torch.equal(a["logits"], b["logits"]) for a, b in zip(outs, tp1_logits[name]))
    destroy()
    for ep in (1, 4):
        back = work / f"back_moe_ep{ep}"
        res[f"convert/mcore_to_hf_ep{ep}_rc"] = convert.main(
            ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back), "--ep", str(ep)])
        if rank == 0:
            res[f"convert/back_ep{ep}_bitwise"] = compare_hf_dirs(work / name, back, expect_index=False)


def main() -> None:
    rank_main(lambda opts, res: run_cases(opts.out / "work", res, int(os.environ["RANK"])))


if __name__ == "__main__":
    main()
