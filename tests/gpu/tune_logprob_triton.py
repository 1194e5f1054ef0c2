"""Time the Triton fused log-prob (forward + backward) for several tile shapes at a model's shapes, beside
Liger-Kernel's fused linear cross-entropy when it is installed. Prints one JSON line; pick the default tiles
(kernels/logprob_triton.py) from it.   python tests/gpu/tune_logprob_triton.py [N H]"""
from __future__ import annotations

import json
import sys

import torch
import triton.testing

from mppo.kernels import fused_linear_logprob_entropy, logprob_triton

VOCAB = 151_936
CONFIGS = [  # BLOCK_N, BLOCK_V, BLOCK_H, num_warps
    (64, 128, 32, 8), (128, 128, 64, 8), (128, 256, 64, 8), (64, 256, 64, 4),
]


def main() -> None:
    n, h = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16384, 2048)
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(VOCAB, h, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (n,), device="cuda", generator=g)
    out: dict = {"n": n, "h": h, "vocab": VOCAB}

    def ours() -> None:
        x = hidden.detach().requires_grad_()
        lp, ent = fused_linear_logprob_entropy(x, weight, labels, backend="triton")
        (lp.sum() + 0.1 * ent.sum()).backward()

    reference = None
    for bn, bv, bh, warps in CONFIGS:
        key = f"{bn}x{bv}x{bh}w{warps}"
        logprob_triton.BLOCK_N, logprob_triton.BLOCK_V, logprob_triton.BLOCK_H = bn, bv, bh
        logprob_triton.NUM_WARPS = warps
        try:
            ours()
            x = hidden.detach().requires_grad_()
            lp, _ = fused_linear_logprob_entropy(x, weight, labels, backend="triton")
            lp.sum().backward()
            if reference is None:
                reference = (lp.detach().clone(), x.grad.float().clone())
            err = max((lp - reference[0]).abs().max().item(), (x.grad.float() - reference[1]).abs().max().item())
            out[key] = {"ms": triton.testing.do_bench(ours, warmup=3, rep=20), "max_diff_vs_first": err}
        except Exception as e:  # a tile that does not fit (shared memory) is a result, not a stop
            out[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def liger() -> None:
            x = hidden.detach().requires_grad_()
            loss(weight, x, labels).backward()
        out["liger_ms"] = triton.testing.do_bench(liger, warmup=3, rep=20)
    except ImportError:
        out["liger_ms"] = None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
