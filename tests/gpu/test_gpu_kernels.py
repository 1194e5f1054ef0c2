"""Compiled Triton kernels on the GPU at a real model's shapes (Qwen2.5 vocab 151,936, padded to a multiple of
128 as megatron pads it): values and gradients vs the float64 naive reference on the same device, and the peak
memory of fused vs naive forward+backward."""
from __future__ import annotations

import pytest
import torch

from gpu_report import peak_mib, report
from test_kernels_logprob import assert_close, make_problem, reference_and_fused

VOCAB, PADDED = 151_936, 152_064


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 5e-5), (torch.bfloat16, 2e-2)])
def test_triton_logprob_at_model_shapes(dtype, rtol):
    hidden, weight, labels = (t.cuda() for t in make_problem(2048, 896, PADDED, valid=VOCAB, dtype=dtype, seed=7))
    fused, ref = reference_and_fused(hidden, weight, labels, backend="triton", temperature=0.9, valid=VOCAB)
    assert_close(fused[:2], ref[:2], rtol=5e-5 if dtype == torch.float32 else 1e-4)  # fp32 statistics
    assert_close((None, None) + tuple(fused[2:]), (None, None) + tuple(ref[2:]), rtol=rtol)


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


@pytest.mark.parametrize("dtype,rtol,grad_rtol", [(torch.float32, 5e-5, 5e-5), (torch.bfloat16, 1e-4, 2e-2)])
def test_triton_fused_ppo_loss_at_model_shapes(dtype, rtol, grad_rtol):
    # ~400 tokens of a 152,064-row (padded) head at hidden 896: several row chunks and the real vocabulary
    from test_kernels_ppo import GLOBAL_INFO, Knobs, assert_matches, fused, make_problem, reference

    p = make_problem(b=8, t=60, h=896, vocab=PADDED, valid_vocab=VOCAB, seed=9, dtype=dtype, temperature=0.9)
    k = Knobs(mode="seq-mean-token-mean", info=GLOBAL_INFO, temperature=0.9, valid_vocab=VOCAB)
    got = fused(p, k, backend="triton", chunk_rows=256, device="cuda")
    ref_problem = type(p)(**{**vars(p), "hidden": p.hidden.double(), "weight": p.weight.double()})
    assert_matches(got, reference(ref_problem, k), rtol=rtol, grad_rtol=grad_rtol)


def test_fused_ppo_loss_memory_is_a_fraction_of_naive():
    from mppo.kernels import PPOTokenLoss, fused_linear_ppo_loss

    hidden, weight, labels = (t.cuda() for t in make_problem(8192, 896, PADDED, valid=VOCAB,
                                                             dtype=torch.bfloat16, seed=8))
    weight.requires_grad_()
    n = hidden.shape[0]
    spec = PPOTokenLoss(advantages=torch.randn(n, device="cuda"), weights=torch.full((n,), 1 / n, device="cuda"),
                        mask=torch.ones(n, device="cuda"), entropy_coeff=0.01)

    def run_fused() -> None:
        h = hidden.detach().requires_grad_()
        fused_linear_ppo_loss(h, weight, labels, spec, valid_vocab_size=VOCAB, backend="triton").loss.backward()
        weight.grad = None

    def run_naive() -> None:
        from mppo.kernels import fused_linear_logprob_entropy
        h = hidden.detach().requires_grad_()
        lp, ent = fused_linear_logprob_entropy(h, weight, labels, valid_vocab_size=VOCAB, backend="naive")
        (lp.sum() + 0.1 * ent.sum()).backward()
        weight.grad = None

    run_fused(), run_naive()  # compile and warm the allocator outside the measurement
    naive, fused_mib = peak_mib(run_naive), peak_mib(run_fused)
    report("kernels_ppo_memory", {"tokens": 8192, "hidden": 896, "vocab": PADDED, "dtype": "bf16",
                                  "naive_peak_mib": naive, "fused_ppo_peak_mib": fused_mib, "ratio": fused_mib / naive})
    assert fused_mib / naive <= 0.10, (fused_mib, naive)
