"""Compiled Triton kernels on the GPU at a real model's shapes (Qwen2.5 vocab 151,936, padded to a multiple of
128 as megatron pads it): values and gradients vs the float64 naive reference on the same device, and the peak
memory of fused vs naive forward+backward."""
from __future__ import annotations

import pytest
import torch

from gpu_report import report
from test_kernels_logprob import assert_close, make_problem, reference_and_fused

VOCAB, PADDED = 151_936, 152_064


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])
def test_triton_logprob_at_model_shapes(dtype, rtol):
    hidden, weight, labels = (t.cuda() for t in make_problem(2048, 896, PADDED, valid=VOCAB, dtype=dtype, seed=7))
    fused, ref = reference_and_fused(hidden, weight, labels, backend="triton", temperature=0.9, valid=VOCAB)
    assert_close(fused[:2], ref[:2], rtol=5e-5 if dtype == torch.float32 else 1e-4)  # fp32 statistics
    assert_close((None, None) + tuple(fused[2:]), (None, None) + tuple(ref[2:]), rtol=rtol)


def peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def test_fused_memory_is_a_fraction_of_naive():
    from mppo.kernels import fused_linear_logprob_entropy

    hidden, weight, labels = (t.cuda() for t in make_problem(8192, 896, PADDED, valid=VOCAB,
                                                             dtype=torch.bfloat16, seed=8))
    weight.requires_grad_()

    def run(backend: str) -> None:
        h = hidden.detach().requires_grad_()
        lp, ent = fused_linear_logprob_entropy(h, weight, labels, valid_vocab_size=VOCAB, backend=backend)
        (lp.sum() + 0.1 * ent.sum()).backward()
        weight.grad = None

    run("triton"), run("naive")  # compile and warm the allocator outside the measurement
    naive, fused = peak_mib(lambda: run("naive")), peak_mib(lambda: run("triton"))
    report("kernels_memory", {"tokens": 8192, "hidden": 896, "vocab": PADDED, "dtype": "bf16",
                              "naive_peak_mib": naive, "triton_peak_mib": fused, "ratio": fused / naive})
    assert fused / naive <= 0.10, (fused, naive)
