"""Triton kernels under TRITON_INTERPRET=1 (set in conftest.py) vs the float64 naive reference, at small shapes.

Interpreter cost grows with programs × tile iterations, so shapes stay small; they are still chosen to leave
partial tiles in every dimension (N, V, H not multiples of the 64/128/64 blocks)."""
from __future__ import annotations

import os

import pytest
import torch

from mppo.kernels import fused_linear_logprob_entropy, fused_ppo_loss
from mppo.kernels.reference import naive_ppo_loss
from test_kernels_logprob import assert_close, make_problem, reference_and_fused
from test_kernels_ppo import make_batch

# On a GPU test run (MPPO_TEST_ON_GPU=1, no interpreter) the same checks run on CUDA tensors.
DEVICE = torch.device("cuda" if os.environ.get("MPPO_TEST_ON_GPU") and torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on CPU runs only under TRITON_INTERPRET=1 (conftest.py sets it)")


def on_device(*tensors):
    return tuple(t.to(DEVICE) if t is not None else None for t in tensors)

LOGPROB_CASES = [
    # n, hidden, vocab, temperature, valid vocab, chunk (= vocab columns per split / per backward chunk)
    (37, 16, 101, 1.0, None, None),
    (70, 40, 300, 0.7, None, 130),     # 2 row blocks, 3 vocab splits, H spans one partial block
    (65, 72, 200, 1.3, 173, None),     # padded vocab; H = 72 needs two BLOCK_H slices
]


@pytest.mark.parametrize("n,hidden_size,vocab,temperature,valid,chunk", LOGPROB_CASES)
def test_triton_logprob_fp32_matches_reference(n, hidden_size, vocab, temperature, valid, chunk):
    hidden, weight, labels = on_device(*make_problem(n, hidden_size, vocab, valid=valid, seed=3))
    fused, ref = reference_and_fused(hidden, weight, labels, backend="triton", temperature=temperature,
                                     valid=valid, chunk=chunk)
    assert_close(fused, ref, rtol=2e-5)


@pytest.mark.parametrize("n,hidden_size,vocab,temperature,valid,chunk", LOGPROB_CASES[:2])
def test_triton_logprob_bf16_matches_reference(n, hidden_size, vocab, temperature, valid, chunk):
    hidden, weight, labels = on_device(*make_problem(n, hidden_size, vocab, valid=valid, dtype=torch.bfloat16,
                                                     seed=4))
    fused, ref = reference_and_fused(hidden, weight, labels, backend="triton", temperature=temperature,
                                     valid=valid, chunk=chunk)
    assert fused[2].dtype == torch.bfloat16
    assert_close(fused[:2], ref[:2], rtol=2e-5)  # fp32 statistics of the exact bf16 values
    assert_close((None, None) + fused[2:], (None, None) + ref[2:], rtol=2e-2)  # grads rounded to bf16 once


def test_triton_and_torch_backends_agree_without_entropy():
    hidden, weight, labels = on_device(*make_problem(40, 24, 150, seed=5))
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    lp1, ent1 = fused_linear_logprob_entropy(h1, weight, labels, compute_entropy=False, backend="triton")
    lp2, _ = fused_linear_logprob_entropy(h2, weight, labels, compute_entropy=False, backend="torch")
    assert ent1 is None
    lp1.sum().backward()
    lp2.sum().backward()
    assert torch.allclose(lp1, lp2, atol=1e-5) and torch.allclose(h1.grad, h2.grad, atol=1e-5)


def test_triton_no_grad_forward():
    hidden, weight, labels = on_device(*make_problem(20, 8, 60, seed=6))
    with torch.no_grad():
        lp, ent = fused_linear_logprob_entropy(hidden.requires_grad_(), weight, labels, backend="triton")
    ref_lp, ref_ent = fused_linear_logprob_entropy(hidden.detach(), weight, labels, backend="torch")
    assert lp.grad_fn is None
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)


def test_triton_rejects_fp64():
    hidden, weight, labels = on_device(*make_problem(4, 4, 9, dtype=torch.float64))
    with pytest.raises(TypeError, match="backend='torch'"):
        fused_linear_logprob_entropy(hidden, weight, labels, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_triton_ppo_loss_matches_reference(dtype, mode):
    old, lp, adv, mask, isw = on_device(*make_batch(5, 300, seed=7))  # T spans two 256-token blocks
    old, lp, adv = old.to(dtype), lp.to(dtype), adv.to(dtype)
    kwargs = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, rollout_is_weights=isw,
                  dp_size=2, batch_num_tokens=900, global_batch_size=12)
    x = lp.clone().requires_grad_()
    loss, metrics = fused_ppo_loss(old, x, adv, mask, mode, backend="triton", **kwargs)
    loss.backward()
    y = lp.double().requires_grad_()
    ref_loss, ref_metrics = naive_ppo_loss(old.double(), y, adv.double(), mask, mode, **kwargs)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert x.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2 * y.grad.abs().max().item()
    assert (x.grad.double() - y.grad).abs().max().item() < tol
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
