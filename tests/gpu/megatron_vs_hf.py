"""Megatron (nccl, one CUDA device; the SDPA attention spec and megatron's local spec) vs HF transformers on the
same GPU; plus bf16 actor forward+backward throughput (tokens/s, MFU) at Qwen2.5-0.5B and 1.5B shapes, 4k-token
sequences, for both specs. Run as a lone process by tests/gpu/test_gpu_megatron.py:
`python megatron_vs_hf.py WORK_DIR`. Prints one JSON line.

References are independent: HF's own forward (eager attention) on the same weights, fp32 on the GPU.
"""
from __future__ import annotations

import json
import traceback
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))
from models_fixtures import make_hf_model  # noqa: E402
from models_parallel import (TEMPERATURE, final_norm_grad_diff, hf_reference, max_diff, micro_batches,  # noqa: E402
                             run_logits)
from next_token import next_token_loss_step, token_logprobs  # noqa: E402


IMPLS = ("local", "sdpa")  # local first: the SDPA results are compared with it
# (name, HF config) of the throughput shapes: Qwen2.5-0.5B and -1.5B with random weights
SHAPES = {
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "max_position_embeddings": 32768},
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True, "max_position_embeddings": 32768},
}
SEQ_LEN = 4096
# CUDA is the point; the CPU fallback only lets a developer dry-run this script's logic without a GPU
# (`TRITON_INTERPRET=1 python tests/gpu/megatron_vs_hf.py /tmp/dry`): every parity case, and the throughput
# stage on a tiny shape and short sequences with the torch log-prob kernel (no MFU: there is no matmul peak).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DRY_RUN_SHAPES = {"tiny": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                           "tie_word_embeddings": True, "max_position_embeddings": 256}}
DRY_RUN_SEQ_LEN = 256


def to_device(batches: list[dict]) -> list[dict]:
    return [{k: v.to(DEVICE) for k, v in b.items()} for b in batches]


def parity_cases(work: Path, dims, res: dict) -> None:
    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import iter_hf_weights, load_hf_weights

    for name in ("qwen2_untied", "llama_tied"):
        hf = make_hf_model(name, work / name).to(DEVICE)
        args = read_hf_config(work / name)
        batches = to_device(micro_batches(args.vocab_size, seed=11))
        refs = hf_reference(hf, batches)
        local_logits_by_dtype: dict = {}
        for impl, dtype in [(i, d) for i in IMPLS for d in (torch.float32, torch.bfloat16)]:
            tag = f"{name}/{impl}/{str(dtype).split('.')[-1]}"
            chunks = build_gpt_model(args, dims, role="actor", dtype=dtype, transformer_impl=impl)
            res[f"{tag}/param_device"] = str(next(chunks[0].parameters()).device)
            res[f"{tag}/core_attention"] = type(chunks[0].decoder.layers[0].self_attention.core_attention).__name__
            load_hf_weights(chunks, work / name, args)
            logits = run_logits(chunks, batches, args.vocab_size)
            res[f"{tag}/logits"] = max_diff(logits, refs, "logits")
            if impl == "local":
                local_logits_by_dtype[dtype] = logits
            else:  # the SDPA spec against megatron's own attention, same weights and dtype
                res[f"{tag}/logits_vs_local"] = max_diff(logits, local_logits_by_dtype[dtype], "logits")
            lp = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
            res[f"{tag}/log_probs"] = max_diff(lp, refs, "log_probs")
            res[f"{tag}/entropy"] = max_diff(lp, refs, "entropy")
            fused = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE,
                                   impl="fused", kernel_backend="triton")
            res[f"{tag}/triton_log_probs"] = max_diff(fused, refs, "log_probs")
            res[f"{tag}/triton_entropy"] = max_diff(fused, refs, "entropy")
            if dtype == torch.float32:
                exported = dict(iter_hf_weights(chunks, args))
                originals = {k: v for k, v in hf.state_dict().items() if k in exported}
                res[f"{tag}/export_bitwise"] = bool(originals) and all(
                    torch.equal(exported[k].to(DEVICE), originals[k]) for k in originals)
                res[f"{tag}/final_norm_grad"] = final_norm_grad_diff(chunks, batches, args, hf)
            del chunks
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()


def moe_parity_cases(work: Path, dims, res: dict) -> None:
    """Qwen3-MoE tiny (4 experts, top-2, one dense layer) at EP1 on the GPU vs HF on the same GPU, both specs, fp32
    and bf16; the fp32 export equals the HF checkpoint bitwise."""
    from safetensors.torch import load_file

    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import iter_hf_weights, load_hf_weights

    name = "qwen3_moe"
    hf = make_hf_model(name, work / name).to(DEVICE)
    args = read_hf_config(work / name)
    batches = to_device(micro_batches(args.vocab_size, seed=12))
    refs = hf_reference(hf, batches)
    original = load_file(str(work / name / "model.safetensors"))
    for impl, dtype in [(i, d) for i in IMPLS for d in (torch.float32, torch.bfloat16)]:
        tag = f"{name}/{impl}/{str(dtype).split('.')[-1]}"
        chunks = build_gpt_model(args, dims, role="actor", dtype=dtype, transformer_impl=impl)
        load_hf_weights(chunks, work / name, args)
        res[f"{tag}/param_device"] = str(next(chunks[0].parameters()).device)
        res[f"{tag}/logits"] = max_diff(run_logits(chunks, batches, args.vocab_size), refs, "logits")
        lp = token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
        res[f"{tag}/log_probs"] = max_diff(lp, refs, "log_probs")
        if dtype == torch.float32:
            exported = dict(iter_hf_weights(chunks, args))
            res[f"{tag}/export_bitwise"] = sorted(exported) == sorted(original) and all(
                torch.equal(exported[k].cpu(), original[k]) for k in original)
        del chunks
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


def peak_bf16_tflops() -> float:
    """This GPU's measured dense bf16 matmul rate (the MFU denominator), best of 10 after warm-up."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * 8192 ** 3 / best / 1e12


def sdpa_kernels(seq_len: int) -> dict:
    """Which kernel torch SDPA runs for mppo's SDPAttention on this device: causal GQA attention with the
    Qwen2.5-0.5B heads (14 query, 2 KV, head dim 64), no mask (what mppo passes) and with a padding mask, bf16 and
    fp32; and whether K/V had to be repeated to the query heads for it (`kv_for_fused_kernel`)."""
    from mppo.models.attention import kv_for_fused_kernel, sdpa_backend

    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 14, seq_len, 64, device=DEVICE, dtype=dtype)
        kv = torch.randn(1, 2, seq_len, 64, device=DEVICE, dtype=dtype)
        keep = torch.ones(1, 1, seq_len, seq_len, device=DEVICE, dtype=torch.bool).tril()
        keep[..., -3:] = False  # three trailing padding keys
        for case, mask, causal in (("causal", None, True), ("masked", keep, False)):
            k, v = kv_for_fused_kernel(q, kv, kv, mask, 0.0, causal)
            tag = f"sdpa_kernel/{str(dtype).split('.')[-1]}/{case}"
            out[tag] = sdpa_backend(q, k, v, mask, 0.0, causal).name
            out[f"{tag}/kv_repeated"] = k.shape[1] != kv.shape[1]
    return out


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def update_throughput(dims, res: dict) -> None:
    """Forward+backward through mppo's pipeline schedule of Qwen2.5-0.5B/1.5B-shaped actors (random weights, bf16,
    the Triton fused log-prob loss) on micro-batches of one 4,096-token sequence: tokens/s and MFU against the
    measured matmul peak, for the SDPA spec and megatron's local spec (unfused attention, [heads, s, s] scores)."""
    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.workers.pipeline import run_pipeline

    cuda = DEVICE.type == "cuda"
    shapes, seq_len = (SHAPES, SEQ_LEN) if cuda else (DRY_RUN_SHAPES, DRY_RUN_SEQ_LEN)
    peak = peak_bf16_tflops() if cuda else None
    res["peak_tflops"] = peak
    res.update(sdpa_kernels(seq_len))
    for shape, config in shapes.items():
        args = read_hf_config(config)
        g = torch.Generator().manual_seed(0)
        batches = to_device([{"input_ids": torch.randint(0, args.vocab_size, (1, seq_len), generator=g)}
                             for _ in range(4)])
        for impl in ("sdpa", "local"):
            key = f"update/{shape}/{impl}"
            try:
                chunks = build_gpt_model(args, dims, role="actor", dtype=torch.bfloat16, transformer_impl=impl)
                params = sum(p.numel() for p in chunks[0].parameters())
                # the workers' forward step and fused log-prob kernel, one sequence per micro-batch (entropy too,
                # as the actor's loss computes it)
                inputs, step = next_token_loss_step(chunks, batches, vocab_size=args.vocab_size, temperature=1.0,
                                                    entropy_coeff=0.0, impl="fused",
                                                    kernel_backend="triton" if cuda else "torch", micro_batch_size=1)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                for _ in range(2):
                    run_pipeline(chunks, inputs, step, forward_only=False)
                synchronize()
                times = []
                for _ in range(5):
                    t = time.perf_counter()
                    run_pipeline(chunks, inputs, step, forward_only=False)
                    synchronize()
                    times.append(time.perf_counter() - t)
                sec = sorted(times)[len(times) // 2]
                tokens = seq_len * len(batches)
                # 6 x params per token (dense fwd+bwd) + causal attention scores and values: 6 x layers x hidden x s
                flops = 6 * params * tokens + 6 * args.num_layers * args.hidden_size * seq_len * tokens
                res[key] = {"params": params, "tokens": tokens, "seq_len": seq_len, "median_s": sec,
                            "tokens_per_s": tokens / sec, "tflops": flops / sec / 1e12, "peak_tflops": peak,
                            "mfu": flops / sec / 1e12 / peak if peak else None,
                            "core_attention": type(chunks[0].decoder.layers[0].self_attention.core_attention).__name__,
                            "max_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}
            except Exception as err:  # noqa: BLE001 - one shape running out of memory must not hide the others
                res[key] = {"error": f"{type(err).__name__}: {err}"[:500]}
            chunks = None
            if cuda:
                torch.cuda.empty_cache()
    res["update"] = res[f"update/{next(iter(shapes))}/sdpa"]  # the headline figure (docs/GPU.md)


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    from mppo.parallel import init_distributed

    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "cpu"}
    dims = init_distributed(1, 1, seed=1234)
    res["dims"] = [dims.backend, str(dims.device)]
    for name, run in (("parity_cases", lambda: parity_cases(work, dims, res)),
                      ("moe_parity_cases", lambda: moe_parity_cases(work, dims, res)),
                      ("update_throughput", lambda: update_throughput(dims, res))):
        try:
            run()
        except Exception as err:  # report and go on: one failure must not hide the other stage's result
            res[f"{name}/error"] = traceback.format_exc()[-3000:]
            print(err, file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
