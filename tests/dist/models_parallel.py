"""torchrun script (4 CPU ranks, gloo): megatron actor/critic vs HF transformers at several TP/PP layouts, with the
SDPA attention spec (the default on CPU) and, for two models, megatron's local spec as a reference.

One launch runs every case and writes out/rank{R}.json: {case name: number or string}. The pytest side
(tests/test_models_parallel.py) asserts on them. References are independent of the code under test: HF
transformers' forward, naive log-softmax/entropy, the original safetensors files.
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
from models_fixtures import MODELS, load_hf_model, make_hf_model, save_tiny_tokenizer  # noqa: E402
from lora_cases import MODEL as LORA_MODEL, adapter_tensors, hf_lora_reference, lora_layout_cases  # noqa: E402
from lora_cases import hf_adapter_grads  # noqa: E402
from next_token import (next_token_loss_step, token_logits, token_logprobs, token_values,  # noqa: E402
                        unpadded_micro_batches)

LAYOUTS = [(2, 2, None), (2, 1, None), (1, 2, None), (1, 1, None), (1, 2, 2)]  # (tp, pp, vpp)
# Models also built with megatron's local spec (DotProductAttention) at every layout: GQA with and without rope
# scaling. The default build (transformer_impl=auto) is the SDPA spec on CPU.
LOCAL_REFERENCE_MODELS = ("qwen2_untied", "llama_tied")
MICRO_BATCH_SHAPES = [(2, 12), (3, 7), (1, 16), (2, 9)]  # (b, s): uneven on purpose
TEMPERATURE = 0.7


def micro_batches(vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for b, s in MICRO_BATCH_SHAPES:
        ids = torch.randint(0, vocab, (b, s), generator=g)
        lengths = torch.randint(s // 2, s + 1, (b,), generator=g)
        ids[torch.arange(s)[None, :] >= lengths[:, None]] = 0  # right padding (pad id 0)
        out.append({"input_ids": ids})
    return out


def hf_reference(hf, batches, head: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[dict]:
    """Logits, next-token log-probs/entropy at TEMPERATURE, and (with a head) critic values, from HF."""
    refs = []
    with torch.no_grad():
        for mb in batches:
            ids = mb["input_ids"]
            out = hf(ids)
            logits = out.logits.float()
            logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            next_lp = torch.zeros(ids.shape, device=ids.device)
            next_lp[:, :-1] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
            ent[:, -1] = 0
            ref = {"logits": logits, "log_probs": next_lp, "entropy": ent}
            if head is not None:
                hidden = hf.model(ids).last_hidden_state  # after the final norm
                ref["values"] = (hidden @ head[0].t() + head[1]).squeeze(-1)
            refs.append(ref)
    return refs


def max_diff(outs: list[dict], refs: list[dict], key: str) -> float:
    assert len(outs) == len(refs), (len(outs), len(refs))
    return max((o[key].float() - r[key].float()).abs().max().item() for o, r in zip(outs, refs))


def run_logits(chunks, batches, vocab: int) -> list[dict]:
    """Logits per micro-batch through the workers' forward path (tests/dist/next_token.py)."""
    return token_logits(chunks, batches, vocab)


def core_attention_name(chunks) -> str:
    """The class name of the core attention of the first layer of the first chunk that has layers."""
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    return type(layers[0].self_attention.core_attention).__name__


def value_head(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(1, hidden, generator=g) * 0.3, torch.randn(1, generator=g)


def run_cases(work: Path, res: dict, rank: int) -> None:
    from mppo.models.builders import build_gpt_model
    from mppo.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import bucketed, iter_hf_weights, load_hf_weights, save_hf_checkpoint
    from mppo.parallel import ParallelLayoutError, destroy, init_distributed
    from mppo.workers.pipeline import run_pipeline
    from safetensors.torch import load_file

    if rank == 0:
        for i, name in enumerate(MODELS):
            make_hf_model(name, work / name, seed=i)
        save_tiny_tokenizer(work / "qwen2_untied", MODELS["qwen2_untied"][1]["vocab_size"])
    dist.barrier()
    hf_models = {name: load_hf_model(work / name) for name in MODELS}
    margs = {name: read_hf_config(work / name) for name in MODELS}
    batches = {name: micro_batches(margs[name].vocab_size, seed=i) for i, name in enumerate(MODELS)}
    heads = {name: value_head(margs[name].hidden_size) for name in MODELS}
    refs = {name: hf_reference(hf_models[name], batches[name], heads[name]) for name in MODELS}
    originals = {name: load_file(str(work / name / "model.safetensors")) for name in MODELS}
    lora_tensors = adapter_tensors(margs[LORA_MODEL])
    lora_refs, _ = hf_lora_reference(work, lora_tensors, batches[LORA_MODEL], hf_reference, load_hf_model)
    lora_grads = hf_adapter_grads(work, lora_tensors, batches[LORA_MODEL], load_hf_model)
    lora_outputs: dict[str, list] = {}

    # The llama3 rope scaling must matter for these inputs, or the llama cases would not test it.
    llama = hf_models["llama_tied"]
    unscaled = make_unscaled_llama(llama)
    with torch.no_grad():
        ids = batches["llama_tied"][2]["input_ids"]
        res["rope_scaling_effect"] = (unscaled(ids).logits - llama(ids).logits).abs().max().item()

    # A layout that does not divide the world stops before any group is made.
    try:
        init_distributed(3, 1)
        res["bad_layout_error"] = "no error"
    except ParallelLayoutError as err:
        res["bad_layout_error"] = str(err)

    tp1_logits: dict[str, list] = {}
    for tp, pp, vpp in LAYOUTS:
        layout = f"tp{tp}pp{pp}" + (f"vpp{vpp}" if vpp else "")
        dims = init_distributed(tp, pp, vpp, seed=1234)
        res[f"{layout}/dims"] = [dims.tp_rank, dims.pp_rank, dims.dp_rank, dims.dp]
        for name in MODELS:
            args = margs[name]
            key = f"{layout}/{name}"
            try:
                chunks = build_gpt_model(args, dims, role="actor")
            except ParallelLayoutError as err:  # e.g. 2 layers over pp2 x vpp2
                res[f"{key}/layout_error"] = str(err)
                continue
            res[f"{layout}/batch_p2p_comm"] = chunks[0].config.batch_p2p_comm
            res[f"{key}/core_attention"] = core_attention_name(chunks)
            load_hf_weights(chunks, work / name, args)
            outs = run_logits(chunks, batches[name], args.vocab_size)
            res[f"{key}/logits"] = max_diff(outs, refs[name], "logits")
            if (tp, pp, vpp) == (1, 1, None):
                tp1_logits[name] = outs
            if name == LORA_MODEL and vpp is None:
                lora_layout_cases(work, res, key, tp, args, dims, batches[name], outs, lora_refs, lora_tensors,
                                  lora_grads, lora_outputs)
            lp = token_logprobs(chunks, batches[name], vocab_size=args.vocab_size, temperature=TEMPERATURE)
            res[f"{key}/log_probs"] = max_diff(lp, refs[name], "log_probs")
            res[f"{key}/entropy"] = max_diff(lp, refs[name], "entropy")
            if name in LOCAL_REFERENCE_MODELS:  # megatron's own attention, the reference the SDPA spec replaces
                local = build_gpt_model(args, dims, role="actor", transformer_impl="local")
                res[f"{key}/local/core_attention"] = core_attention_name(local)
                load_hf_weights(local, work / name, args)
                local_outs = run_logits(local, batches[name], args.vocab_size)
                res[f"{key}/local/logits"] = max_diff(local_outs, refs[name], "logits")
                res[f"{key}/local/logits_vs_sdpa"] = max_diff(local_outs, outs, "logits")
                local_lp = token_logprobs(local, batches[name], vocab_size=args.vocab_size,
                                          temperature=TEMPERATURE)
                res[f"{key}/local/log_probs"] = max_diff(local_lp, refs[name], "log_probs")
                del local

            if (tp, pp, vpp) == (2, 2, None):  # HF -> Megatron (TP2 x PP2) -> HF, bitwise
                exported = dict(iter_hf_weights(chunks, args))
                res[f"{key}/export_names_equal"] = sorted(exported) == sorted(originals[name])
                res[f"{key}/export_bitwise"] = all(
                    torch.equal(exported[k], originals[name][k]) and exported[k].dtype == originals[name][k].dtype
                    for k in originals[name] if k in exported)
                buckets = list(bucketed(iter_hf_weights(chunks, args), bucket_bytes=40_000))
                res[f"{key}/bucket_max_bytes"] = max(
                    sum(t.numel() * t.element_size() for _, t in b) for b in buckets if len(b) > 1)
                res[f"{key}/bucket_order_same"] = [n for b in buckets for n, _ in b] == list(exported)
                save_hf_checkpoint(iter_hf_weights(chunks, args), work / f"roundtrip_{name}", args,
                                   tokenizer_dir=work / name, max_shard_bytes=100_000)
                if rank == 0:
                    res[f"{key}/roundtrip_files_bitwise"] = compare_hf_dirs(work / name, work / f"roundtrip_{name}")

            if vpp and name == "qwen2_tied":
                try:
                    _, step = next_token_loss_step(chunks, batches[name], vocab_size=args.vocab_size,
                                                   temperature=TEMPERATURE)
                    run_pipeline(chunks, unpadded_micro_batches(chunks, batches[name]), step)
                    res[f"{key}/uneven_shapes_error"] = "no error"
                except ValueError as err:
                    res[f"{key}/uneven_shapes_error"] = str(err)
            if name == "qwen2_tied" and (tp, pp, vpp) in ((2, 2, None), (1, 2, 2)):
                res[f"{key}/final_norm_grad"] = final_norm_grad_diff(chunks, batches[name], args, hf_models[name])

            if name in ("qwen2_untied", "qwen2_tied", "llama_tied") and vpp is None:
                critic = build_gpt_model(args, dims, role="critic")
                load_hf_weights(critic, work / name, args)
                head = critic[-1].output_layer if critic[-1].post_process else None
                if head is not None:
                    res[f"{key}/critic_head_zero_init"] = bool(head.weight.abs().sum() == 0
                                                               and head.bias.abs().sum() == 0)
                    res[f"{key}/critic_head_dtype"] = str(head.weight.dtype)
                    with torch.no_grad():
                        head.weight.copy_(heads[name][0])
                        head.bias.copy_(heads[name][1])
                vals = token_values(critic, batches[name])
                res[f"{key}/values"] = max_diff(vals, refs[name], "values")
                if (tp, pp) == (2, 2) and name == "qwen2_untied":  # critic -> HF (score.*) -> critic
                    res[f"{key}/critic_roundtrip"] = critic_roundtrip(critic, args, dims, batches[name], vals, work,
                                                                      heads[name])
                    save_model_checkpoint(critic, work / "critic_ckpt", args)
                if (tp, pp) == (1, 1) and name == "qwen2_untied":  # the TP2 x PP2 critic checkpoint at TP1
                    again = build_gpt_model(args, dims, role="critic")
                    load_model_checkpoint(again, work / "critic_ckpt")
                    res[f"{key}/critic_ckpt_values"] = max_diff(token_values(again, batches[name]), refs[name],
                                                                "values")
        destroy()

    for key, outs in lora_outputs.items():
        res[f"{key}/lora/log_probs_vs_tp1"] = max_diff(outs, lora_outputs[f"tp1pp1/{LORA_MODEL}"], "log_probs")
    convert_cases(work, res, rank, hf_models, batches, refs, tp1_logits)
    cpu_compat_cases(res, margs["qwen2_untied"], work / "qwen2_untied")


def critic_roundtrip(critic, args, dims, batches, vals, work, head) -> str:
    """Export a critic (HF token-classification names: model.* + score.weight/bias) and load it back."""
    from mppo.models.builders import build_gpt_model
    from mppo.models.weights import iter_hf_weights, load_hf_weights, save_hf_checkpoint

    exported = dict(iter_hf_weights(critic, args))
    if "lm_head.weight" in exported or not torch.equal(exported["score.weight"], head[0]) \
            or not torch.equal(exported["score.bias"], head[1]):
        return f"unexpected critic export: {sorted(k for k in exported if not k.startswith('model.'))}"
    save_hf_checkpoint(iter_hf_weights(critic, args), work / "critic_hf", args)
    again = build_gpt_model(args, dims, role="critic")
    load_hf_weights(again, work / "critic_hf", args)
    vals2 = token_values(again, batches)
    same = all(torch.equal(a["values"], b["values"]) for a, b in zip(vals, vals2))
    return "ok" if same else "values differ after reloading the exported critic"


def final_norm_grad_diff(chunks, batches, args, hf) -> float:
    """Forward-backward through the schedule (the workers' forward step) vs HF autograd: grads of the final and
    first norm weights for loss = sum(log_probs) + 0.1 * sum(entropy) over non-last columns (tests the loss
    scaling and the differentiable vocab-parallel log-prob/entropy)."""
    from mppo.workers.pipeline import run_pipeline

    inputs, step = next_token_loss_step(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE,
                                        entropy_coeff=0.1)
    for c in chunks:
        c.zero_grad(set_to_none=True)
    run_pipeline(chunks, inputs, step, forward_only=False)
    last = [c for c in chunks if c.post_process]
    hf.zero_grad(set_to_none=True)
    total = 0.0
    for mb in batches:
        ids = mb["input_ids"]
        logp = torch.log_softmax(hf(ids).logits.float() / TEMPERATURE, dim=-1)
        lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)[:, :-1]
        total = total + lp.sum() + 0.1 * ent.sum()
    total.backward()

    def rel(got, ref):
        return (got - ref).abs().max().item() / ref.abs().max().item()

    diffs = [0.0]
    if last:  # the final norm lives on the last stage
        diffs.append(rel(last[0].decoder.final_layernorm.weight.grad, hf.model.norm.weight.grad))
    first = [c for c in chunks if c.pre_process]
    if first:  # layer 0's norm on the first stage: its gradient came back through the pipeline
        diffs.append(rel(first[0].decoder.layers[0].input_layernorm.weight.grad,
                          hf.model.layers[0].input_layernorm.weight.grad))
    return max(diffs)


def convert_cases(work, res, rank, hf_models, batches, refs, tp1_logits) -> None:
    """`mppo convert` in-process: HF -> dist ckpt at TP2 x PP2 -> load at TP1 x PP1 -> HF."""
    from mppo.models import convert
    from mppo.models.builders import build_gpt_model
    from mppo.models.checkpoint import checkpoint_hf_dir, load_model_checkpoint
    from mppo.models.hf_config import read_hf_config
    from mppo.parallel import destroy, init_distributed

    for name in ("qwen2_untied", "llama_tied"):
        ckpt, back = work / f"ckpt_{name}", work / f"back_{name}"
        res[f"convert/{name}/hf_to_mcore_rc"] = convert.main(
            ["hf-to-mcore", "--hf", str(work / name), "--out", str(ckpt), "--tp", "2", "--pp", "2"])
        res[f"convert/{name}/exists_again_rc"] = convert.main(
            ["hf-to-mcore", "--hf", str(work / name), "--out", str(ckpt), "--tp", "2", "--pp", "2"])
        dims = init_distributed(1, 1)
        args = read_hf_config(checkpoint_hf_dir(ckpt))
        chunks = build_gpt_model(args, dims)
        load_model_checkpoint(chunks, ckpt)
        outs = run_logits(chunks, batches[name], args.vocab_size)
        res[f"convert/{name}/tp1_logits_vs_hf"] = max_diff(outs, refs[name], "logits")
        res[f"convert/{name}/tp1_logits_identical"] = all(
            torch.equal(a["logits"], b["logits"]) for a, b in zip(outs, tp1_logits[name]))
        destroy()
        res[f"convert/{name}/mcore_to_hf_rc"] = convert.main(
            ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(back)])
        if rank == 0:
            res[f"convert/{name}/back_bitwise"] = compare_hf_dirs(work / name, back, expect_index=False)


def cpu_compat_cases(res, args, hf_dir) -> None:
    """Each CPU patch is still needed: without it the megatron call site it serves fails; with it, it works.

    The probes are rank-local (no collectives), so a failure on one rank cannot hang the others.
    """
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.parallel_state import get_pipeline_model_parallel_group
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from mppo.models.builders import build_gpt_model
    from mppo.parallel import cpu_compat, destroy, init_distributed

    dims = init_distributed(1, 1, seed=5)
    model = build_gpt_model(args, dims)[0]
    seq_len = iter(range(20, 200))  # RotaryEmbedding.forward is lru-cached per length: use a new one each time

    def forward():
        n = next(seq_len)
        model(torch.zeros(1, n, dtype=torch.long), torch.arange(n)[None], None)

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)

    def sequence_parallel_linear() -> None:  # a TP linear's forward and backward under SP (TP group of 1)
        from megatron.core.parallel_state import get_tensor_model_parallel_group
        from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

        x, w = torch.ones(4, 1, 3, requires_grad=True), torch.ones(2, 3, requires_grad=True)
        linear_with_grad_accumulation_and_async_allreduce(
            x, w, None, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=True,
            tp_group=get_tensor_model_parallel_group()).sum().backward()

    probes = {
        "sequence_parallel_backward": sequence_parallel_linear,
        "cuda_device_to_cpu": forward,
        "cuda_current_device": forward,
        "cuda_synchronize": lambda: P2PCommunicator(get_pipeline_model_parallel_group(), model.config)
        ._communicate_shapes(None, None, False, False),
        "cpu_rng_tracker": lambda: model_parallel_cuda_manual_seed(99),
        "tensor_type_names": lambda: clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=0.5),
    }
    res["cpu_compat/patches"] = [p.name for p in cpu_compat.PATCHES]
    res["cpu_compat/installed"] = cpu_compat.installed()
    res["cpu_compat/probed"] = [name for name in res["cpu_compat/patches"] if name in probes]
    for name in res["cpu_compat/patches"]:
        probe = probes.get(name)
        if probe is None:  # the MoE patches are probed in tests/dist/models_moe.py
            res[f"cpu_compat/{name}/without"] = "no probe for this patch"
            continue
        with cpu_compat.without(name):
            try:
                probe()
                res[f"cpu_compat/{name}/without"] = "no error"
            except Exception as err:  # noqa: BLE001 - any failure shows the patch is needed
                res[f"cpu_compat/{name}/without"] = f"{type(err).__name__}: {err}"[:300]
        try:
            probe()
            res[f"cpu_compat/{name}/with"] = "ok"
        except Exception as err:  # noqa: BLE001
            res[f"cpu_compat/{name}/with"] = f"{type(err).__name__}: {err}"[:300]
    res["cpu_compat/installed_after"] = cpu_compat.installed()
    destroy()


def make_unscaled_llama(model):
    from transformers import AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": model.config.rope_parameters["rope_theta"]}
    cfg.pop("rope_scaling", None)
    clone = AutoModelForCausalLM.from_config(type(model.config).from_dict(cfg), attn_implementation="eager")
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def compare_hf_dirs(src: Path, dst: Path, expect_index: bool = True) -> str:
    """'ok' when every tensor (name, dtype, bits) and config.json match; otherwise what differs."""
    from safetensors.torch import load_file

    a = load_file(str(src / "model.safetensors"))
    b = {}
    for f in sorted(dst.glob("*.safetensors")):
        b.update(load_file(str(f)))
    if sorted(a) != sorted(b):
        return f"names differ: {sorted(set(a) ^ set(b))}"
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    if bad:
        return f"tensors differ: {bad}"
    if json.loads((src / "config.json").read_text()) != json.loads((dst / "config.json").read_text()):
        return "config.json differs"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file() and (not (dst / name).is_file()
                                       or (src / name).read_bytes() != (dst / name).read_bytes()):
            return f"{name} missing or different"
    if expect_index and not (dst / "model.safetensors.index.json").is_file():
        return "expected several shards and an index"
    return "ok"


def main() -> None:
    rank_main(lambda opts, res: run_cases(opts.out / "work", res, int(os.environ["RANK"])))


if __name__ == "__main__":
    main()
