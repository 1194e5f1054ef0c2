"""Megatron (local spec, nccl, one CUDA device) vs HF transformers on the same GPU; plus a bf16 update-throughput
measurement. Run as a lone process by tests/gpu/test_gpu_megatron.py: `python megatron_vs_hf.py WORK_DIR`.
Prints one JSON line.

References are independent: HF's own forward (eager attention) on the same weights, fp32 on the GPU.
"""
from __future__ import annotations

import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

from mppo.kernels import fused_linear_logprob_entropy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dist"))
from models_fixtures import make_hf_model  # noqa: E402
from models_parallel import (TEMPERATURE, final_norm_grad_diff, hf_reference, max_diff, micro_batches,  # noqa: E402
                             run_logits)


# CUDA is the point; the CPU fallback only lets a developer dry-run this script's logic without a GPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def to_device(batches: list[dict]) -> list[dict]:
    return [{k: v.to(DEVICE) for k, v in b.items()} for b in batches]


def parity_cases(work: Path, dims, res: dict) -> None:
    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.models.weights import iter_hf_weights, load_hf_weights
    from mppo.workers.pipeline import compute_token_logprobs

    for name in ("qwen2_untied", "llama_tied"):
        hf = make_hf_model(name, work / name).to(DEVICE)
        args = read_hf_config(work / name)
        batches = to_device(micro_batches(args.vocab_size, seed=11))
        refs = hf_reference(hf, batches)
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"{name}/{str(dtype).split('.')[-1]}"
            chunks = build_gpt_model(args, dims, role="actor", dtype=dtype, transformer_impl="local")
            res[f"{tag}/param_device"] = str(next(chunks[0].parameters()).device)
            load_hf_weights(chunks, work / name, args)
            res[f"{tag}/logits"] = max_diff(run_logits(chunks, batches, args.vocab_size), refs, "logits")
            lp = compute_token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE)
            res[f"{tag}/log_probs"] = max_diff(lp, refs, "log_probs")
            res[f"{tag}/entropy"] = max_diff(lp, refs, "entropy")
            fused = compute_token_logprobs(chunks, batches, vocab_size=args.vocab_size, temperature=TEMPERATURE,
                                           logprob_fn=partial(fused_linear_logprob_entropy, backend="triton"))
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


def update_throughput(dims, res: dict) -> None:
    """Forward+backward through mppo's pipeline schedule of a Qwen2-0.5B-shaped actor (random weights, bf16,
    the Triton fused log-prob loss): tokens/s and MFU against the measured peak. Local spec (no Transformer
    Engine on this machine): megatron's unfused attention."""
    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.workers.pipeline import logprob_forward_step, run_pipeline

    args = read_hf_config({"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                           "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                           "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096})
    chunks = build_gpt_model(args, dims, role="actor", dtype=torch.bfloat16, transformer_impl="local")
    params = sum(p.numel() for p in chunks[0].parameters())
    b, s = 8, 1024
    g = torch.Generator().manual_seed(0)
    batches = to_device([{"input_ids": torch.randint(0, args.vocab_size, (b, s), generator=g)} for _ in range(2)])
    step = logprob_forward_step(vocab_size=args.vocab_size, logprob_fn=partial(fused_linear_logprob_entropy,
                                                                                backend="triton"))

    def update() -> None:
        run_pipeline(chunks, batches, step, forward_only=False)

    for _ in range(2):
        update()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        update()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    sec = sorted(times)[len(times) // 2]
    tokens = b * s * len(batches)
    # 6 x params per token (dense fwd+bwd) + causal attention scores and values: 6 x layers x hidden x s per token
    flops = 6 * params * tokens + 6 * args.num_layers * args.hidden_size * s * tokens
    peak = peak_bf16_tflops()
    res["update"] = {"params": params, "tokens": tokens, "median_s": sec, "tokens_per_s": tokens / sec,
                     "tflops": flops / sec / 1e12, "peak_tflops": peak, "mfu": flops / sec / 1e12 / peak,
                     "max_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30}


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    from mppo.parallel import init_distributed

    res: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if DEVICE.type == "cuda" else "cpu"}
    dims = init_distributed(1, 1, seed=1234)
    res["dims"] = [dims.backend, str(dims.device)]
    for stage in (parity_cases, update_throughput) if DEVICE.type == "cuda" else (parity_cases,):
        try:
            stage(work, dims, res) if stage is parity_cases else stage(dims, res)
        except Exception as err:  # report and go on: one failure must not hide the other stage's result
            import traceback
            res[f"{stage.__name__}/error"] = traceback.format_exc()[-3000:]
            print(err, file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
