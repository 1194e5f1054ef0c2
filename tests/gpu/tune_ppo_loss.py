"""Time and peak memory of the Triton fused PPO loss (gradient in the forward) for several row-chunk sizes and
vocab blocks, beside Liger-Kernel's fused linear cross-entropy (the GPU target: <= 1.1x its time with <= its
memory) and mppo's fused log-prob op. Prints one JSON line; pick kernels/ppo_loss.py's CUDA defaults from it.
    python tests/gpu/tune_ppo_loss.py [N H]"""
from __future__ import annotations

import json
import sys

import torch
import triton.testing

from gpu_report import peak_mib
from mppo.kernels import PPOTokenLoss, fused_linear_logprob_entropy, fused_linear_ppo_loss

VOCAB = 151_936
CONFIGS = [  # (chunk_rows, block_cols); None = the default
    (None, None), (64, None), (128, None), (256, None), (512, None), (256, 32768), (512, 32768), (1024, 32768),
]


def main() -> None:
    n, h = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16384, 2048)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(VOCAB, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (n,), device="cuda", generator=g)
    with torch.no_grad():
        current, _ = fused_linear_logprob_entropy(hidden, weight, labels, compute_entropy=False, backend="triton")
    spec = PPOTokenLoss(advantages=torch.randn(n, device="cuda", generator=g),
                        weights=torch.full((n,), 1.0 / n, device="cuda"), mask=torch.ones(n, device="cuda"),
                        old_log_prob=current + 0.1, ref_log_prob=current - 0.1, entropy_coeff=0.01,
                        kl_loss_coef=0.001)
    grad_bytes = (hidden.numel() + weight.numel()) * 2
    out: dict = {"n": n, "h": h, "vocab": VOCAB, "note": "ms = triton.testing.do_bench; extra MiB = peak - inputs"
                                                         " - gradients"}

    def measure(fn) -> dict:
        fn()
        return {"ms": triton.testing.do_bench(fn, warmup=3, rep=20),
                "extra_mib": peak_mib(fn) - grad_bytes / 2 ** 20}

    for rows, cols in CONFIGS:
        def ours(rows=rows, cols=cols) -> None:
            x = hidden.detach().requires_grad_()
            fused_linear_ppo_loss(x, weight, labels, spec, chunk_rows=rows, block_cols=cols,
                                  backend="triton").loss.backward()
            weight.grad = None
        try:
            out[f"ppo rows={rows} cols={cols}"] = measure(ours)
        except Exception as e:  # a configuration that does not fit is a result, not a stop
            out[f"ppo rows={rows} cols={cols}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}

    def recompute() -> None:
        x = hidden.detach().requires_grad_()
        lp, ent = fused_linear_logprob_entropy(x, weight, labels, backend="triton")
        (lp.sum() + 0.01 * ent.sum()).backward()
        weight.grad = None
    out["logprob_recompute"] = measure(recompute)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger() -> None:
            x = hidden.detach().requires_grad_()
            loss(weight, x, labels).backward()
            weight.grad = None
        out["liger"] = measure(liger)
    except ImportError:
        out["liger"] = None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
