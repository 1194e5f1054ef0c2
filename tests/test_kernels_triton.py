"""Triton kernels under TRITON_INTERPRET=1 (set in conftest.py) vs the float64 naive reference, at small shapes.

Interpreter cost grows with programs × tile iterations, so shapes stay small; they are still chosen to leave
partial tiles in every dimension (N, V, H not multiples of the 64/128/64 blocks)."""
from __future__ import annotations

import os

import pytest
import torch

from mppo.core_algos import KL_PENALTY_TYPES, PolicyLossParams, compute_policy_loss_vanilla, kl_penalty
from mppo.kernels import PPOTokenLoss, fused_linear_logprob_entropy
from mppo.kernels.ppo_token_loss import TokenResults
from test_kernels_logprob import assert_close, make_problem, reference_and_fused
from test_kernels_ppo import GLOBAL_INFO, Knobs
from test_kernels_ppo import assert_matches as assert_ppo_matches
from test_kernels_ppo import fused as fused_ppo
from test_kernels_ppo import make_problem as make_ppo_problem
from test_kernels_ppo import reference as ppo_reference

# On a GPU test run (MPPO_TEST_ON_GPU=1, no interpreter) the same checks run on CUDA tensors.
DEVICE = torch.device("cuda" if os.environ.get("MPPO_TEST_ON_GPU") and torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
                                reason="Triton on CPU runs only under TRITON_INTERPRET=1 (conftest.py sets it)")


def triton_token_step(*args):
    from mppo.kernels.ppo_token_triton import token_step  # imports triton
    return token_step(*args)


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


@pytest.mark.parametrize("dtype,rtol,grad_rtol", [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 1e-5, 2e-2)])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_triton_fused_ppo_loss_matches_reference(dtype, rtol, grad_rtol, mode):
    # rows in two chunks, vocab in two blocks of 130 and 70 columns (partial 128-column tiles), H = 72 (two slices)
    p = make_ppo_problem(b=6, t=12, h=72, vocab=200, valid_vocab=187, seed=12, dtype=dtype, temperature=0.8)
    k = Knobs(mode=mode, info=GLOBAL_INFO, temperature=0.8, valid_vocab=187, kl_type="k3+")
    got = fused_ppo(p, k, backend="triton", chunk_rows=40, block_cols=130, device=DEVICE)
    assert got[4].dtype == dtype and got[5].dtype == dtype
    ref_problem = type(p)(**{**vars(p), "hidden": p.hidden.double(), "weight": p.weight.double()})
    assert_ppo_matches(got, ppo_reference(ref_problem, k), rtol=rtol, grad_rtol=grad_rtol)


def test_triton_and_torch_fused_ppo_loss_agree_on_policy():
    p = make_ppo_problem(b=4, t=10, h=24, vocab=150, seed=13)
    k = Knobs(on_policy=True, entropy_coeff=0.0)
    a = fused_ppo(p, k, backend="triton", device=DEVICE)
    b = fused_ppo(p, k, backend="torch")
    for x, y in zip(a, b):
        torch.testing.assert_close(x.cpu(), y, rtol=1e-5, atol=1e-6)
    assert a[1][4].item() == 0.0  # ppo_kl: the ratio is exactly 1


@pytest.mark.parametrize("kl_type", KL_PENALTY_TYPES)
def test_triton_token_step_equals_autograd_of_core_algos(kl_type):
    # one launch per chunk on the GPU: its closed forms (vanilla with ties, every KL estimator) vs autograd through
    # core_algos at fp32 — ratio exactly 1 on collapsed clip bounds, log-ratio exactly ±20 and beyond, A = 0,
    # KL clamps hit exactly (ref − logp = ±20)
    lp = torch.tensor([0.0, 0.3, 20.0, -20.0, 0.3, 0.0, 25.0, -30.0, -0.5, 1.1, 0.0])
    old = torch.zeros_like(lp)
    adv = torch.tensor([1.0, -2.0, -1.0, 1.0, 0.0, -1.0, 1.0, -1.0, 1.0, -1.0, 2.0])
    ref = lp - torch.tensor([0.4, -0.7, 20.0, -20.0, 0.0, 1.5, -0.2, 0.3, 2.0, -3.0, 0.0])
    isw = torch.linspace(0.5, 1.5, len(lp))
    weights = torch.linspace(0.2, 1.0, len(lp))
    for low, high, on_policy in [(0.0, 0.0, False), (0.2, 0.28, False), (0.2, 0.28, True)]:
        spec = PPOTokenLoss(advantages=adv, weights=weights, mask=torch.ones_like(lp),
                            old_log_prob=None if on_policy else old, rollout_is_weights=isw, ref_log_prob=ref,
                            clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0, entropy_coeff=0.05,
                            kl_loss_coef=0.3, kl_loss_type=kl_type)
        n = len(lp)
        results = TokenResults(n, torch.float32, DEVICE, with_kl=True)
        zeros = torch.zeros(n, device=DEVICE)
        # m = 0, s = 1, u = 0: lse = 0 and entropy = 0, so log p = the label logit
        spec = PPOTokenLoss(**{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in vars(spec).items()})
        lse, ent, g_lp, g_ent = triton_token_step(spec.to(torch.float32), results, 0, n, zeros, zeros + 1.0, zeros,
                                                  lp.to(DEVICE), 0.5)
        x = lp.clone().requires_grad_()
        old_ref = x.detach() if on_policy else old
        params = PolicyLossParams(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0)
        pg, metrics = compute_policy_loss_vanilla(old_ref[None], x[None], adv[None], weights[None], "token-sum",
                                                  config=params, rollout_is_weights=isw[None])
        kl = kl_penalty(x, ref, kl_type)
        (pg + 0.3 * (kl * weights).sum()).backward()
        torch.testing.assert_close(g_lp.cpu(), 0.5 * x.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(g_ent.cpu(), -0.05 * weights * 0.5)
        torch.testing.assert_close(results.kl.cpu(), kl.detach(), rtol=1e-6, atol=1e-7)
        assert (results.pg.cpu() * weights).sum().item() == pytest.approx(pg.item(), rel=1e-6)
        assert lse.abs().max().item() == 0.0 and ent.abs().max().item() == 0.0
        clipfrac = (results.clipped.cpu() * weights).sum() / weights.sum()
        assert clipfrac.item() == pytest.approx(metrics["actor/pg_clipfrac"], rel=1e-6, abs=1e-7)
