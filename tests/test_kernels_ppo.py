"""fused_ppo_loss (torch backend) vs the naive veRL-0.9.1 vanilla loss with autograd: every aggregation mode,
global batch info, dual-clip and tie cases, metrics, gradients; and core_algos.compute_policy_loss(loss_mode='vanilla').
The Triton backend runs the same comparison in test_kernels_triton.py."""
from __future__ import annotations

import pytest
import torch

from mppo.core_algos import compute_policy_loss
from mppo.kernels import fused_ppo_loss
from mppo.kernels.reference import naive_ppo_loss

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


def make_batch(bs, seq_len, *, seed=0, dtype=torch.float32):
    """A batch with every branch populated: both advantage signs, ratios far outside the clip range (dual clip),
    a log-ratio beyond ±20, A == 0, a fully masked row, a fractional mask weight."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(bs, seq_len, generator=gen, dtype=torch.float64) * 3
    log_prob = old + torch.randn(bs, seq_len, generator=gen, dtype=torch.float64) * 0.8  # ratios e^±2.4
    adv = torch.randn(bs, seq_len, generator=gen, dtype=torch.float64)
    mask = (torch.rand(bs, seq_len, generator=gen) > 0.25).to(torch.float64)
    isw = torch.rand(bs, seq_len, generator=gen, dtype=torch.float64) + 0.5
    log_prob[0, 0] = old[0, 0] + 25.0  # clamped log-ratio, no gradient
    log_prob[0, 1] = old[0, 1] - 30.0
    adv[0, 2] = 0.0
    mask[1] = 0.0  # fully masked row: excluded from the seq-mean denominators
    mask[2, 3] = 0.5
    mask[0, :3] = 1.0
    return (old.to(dtype), log_prob.to(dtype), adv.to(dtype), mask.to(dtype), isw.to(dtype))


def run_both(old, log_prob, adv, mask, mode, **kwargs):
    x = log_prob.clone().requires_grad_()
    loss, metrics = fused_ppo_loss(old, x, adv, mask, mode, backend="torch", **kwargs)
    loss.backward()
    y = log_prob.clone().requires_grad_()
    ref_loss, ref_metrics = naive_ppo_loss(old, y, adv, mask, mode, **kwargs)
    ref_loss.backward()
    return (loss, metrics, x.grad), (ref_loss, ref_metrics, y.grad)


def assert_same(fused, ref, rtol=1e-12):
    (loss, metrics, grad), (ref_loss, ref_metrics, ref_grad) = fused, ref
    assert loss.item() == pytest.approx(ref_loss.item(), rel=rtol, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=1e-14)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    for key, value in ref_metrics.items():
        assert isinstance(metrics[key], float)
        assert metrics[key] == pytest.approx(value, rel=rtol, abs=1e-12), key


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("global_info", [
    {},
    dict(dp_size=4, batch_num_tokens=613, global_batch_size=24, loss_scale_factor=512.0),
])
def test_every_agg_mode_matches_reference_in_float64(mode, global_info):
    old, lp, adv, mask, isw = make_batch(6, 40, dtype=torch.float64)
    fused, ref = run_both(old, lp, adv, mask, mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                          rollout_is_weights=isw if global_info else None, **global_info)
    assert_same(fused, ref)
    assert fused[2][0, 0] == 0 and fused[2][0, 1] == 0  # |log-ratio| > 20: clamped, no gradient


@pytest.mark.parametrize("mode", AGG_MODES)
def test_float32_inputs(mode):
    old, lp, adv, mask, isw = make_batch(5, 33, seed=2)
    fused, ref = run_both(old, lp, adv, mask, mode, rollout_is_weights=isw)
    assert_same(fused, ref, rtol=2e-6)
    assert fused[0].dtype == torch.float32 and fused[2].dtype == torch.float32


def test_dual_clip_cases_by_hand():
    # A < 0 with a huge ratio: the loss is capped at -A·c and the gradient is 0; A > 0 never dual-clips.
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.log(torch.tensor([[5.0, 5.0, 0.5, 1.1]], dtype=torch.float64))
    adv = torch.tensor([[-1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    x = lp.clone().requires_grad_()
    loss, metrics = fused_ppo_loss(old, x, adv, mask, "token-sum", backend="torch", clip_ratio_c=3.0)
    loss.backward()
    # token 0: dual clip → 3; token 1: clipped → -1.2; token 2: -A·max(0.5, 0.8) = 0.8; token 3: 1.1 (unclipped)
    assert loss.item() == pytest.approx(3.0 - 1.2 + 0.8 + 1.1)
    torch.testing.assert_close(x.grad, torch.tensor([[0.0, 0.0, 0.0, 1.1]], dtype=torch.float64))
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(0.25)  # token 0 only
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)  # tokens 1 and 2 (l2 > l1 strictly)


def test_ties_split_the_gradient_like_torch():
    # ratio exactly on a clip bound, ratio exactly at clip_ratio_c with A < 0, log-ratio exactly ±20, A = 0.
    c = torch.exp(torch.tensor(1.25, dtype=torch.float64)).item()  # dual-clip bound hit exactly by exp(1.25)
    old = torch.zeros(1, 6, dtype=torch.float64)
    lp = torch.tensor([[0.0, 1.25, 20.0, -20.0, 0.3, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, -1.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 6, dtype=torch.float64)
    for low, high in [(0.0, 0.0), (0.2, 0.28)]:
        fused, ref = run_both(old, lp, adv, mask, "token-mean", clip_ratio_low=low, clip_ratio_high=high,
                              clip_ratio_c=c)
        assert_same(fused, ref)


def test_bool_mask_and_no_grad():
    old, lp, adv, mask, _ = make_batch(4, 20, seed=3, dtype=torch.float64)
    with torch.no_grad():
        loss, metrics = fused_ppo_loss(old, lp.requires_grad_(), adv, mask > 0, backend="torch")
    ref_loss, ref_metrics = naive_ppo_loss(old, lp.detach(), adv, (mask > 0).double())
    assert loss.grad_fn is None
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    assert metrics == pytest.approx(ref_metrics)


@pytest.mark.parametrize("kwargs,match", [
    (dict(loss_agg_mode="seq-mean"), "unknown loss_agg_mode"),
    (dict(dp_size=2), "batch_num_tokens"),
    (dict(loss_agg_mode="seq-mean-token-mean", dp_size=2), "global_batch_size"),
    (dict(clip_ratio_c=1.0), "clip_ratio_c must be > 1"),
    (dict(backend="fast"), "unknown kernel backend"),
])
def test_bad_arguments(kwargs, match):
    old, lp, adv, mask, _ = make_batch(4, 8)
    with pytest.raises(ValueError, match=match):
        fused_ppo_loss(old, lp, adv, mask, **{"backend": "torch", **kwargs})


def test_bad_inputs():
    old, lp, adv, mask, _ = make_batch(4, 8)
    with pytest.raises(ValueError, match="advantages has shape"):
        fused_ppo_loss(old, lp, adv[:, :4], mask, backend="torch")
    with pytest.raises(ValueError, match="differentiates only log_prob"):
        fused_ppo_loss(old, lp, adv.requires_grad_(), mask, backend="torch")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_matches_core_algos_compute_policy_loss(mode):
    old, lp, adv, mask, isw = make_batch(6, 40, seed=5, dtype=torch.float64)
    info = dict(dp_size=2, batch_num_tokens=401, global_batch_size=10, loss_scale_factor=64.0)
    x = lp.clone().requires_grad_()
    loss, metrics = fused_ppo_loss(old, x, adv, mask, mode, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                   clip_ratio_c=3.0, rollout_is_weights=isw, backend="torch", **info)
    loss.backward()
    y = lp.clone().requires_grad_()
    ref_loss, ref_metrics = compute_policy_loss(old, y, adv, mask, loss_agg_mode=mode, loss_mode="vanilla",
                                                clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                                                rollout_is_weights=isw, **info)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert metrics[key] == pytest.approx(float(ref_metrics[key]), rel=1e-12, abs=1e-12), key


@pytest.mark.parametrize("mode", AGG_MODES)
def test_nan_under_the_mask_follows_verl(mode):
    # veRL 0.9.1: token modes use masked_sum (NaN under the mask is harmless), seq modes a plain Σ L·m (NaN
    # propagates), and a fully masked row is dropped by masked_sum over rows even when its plain sum is NaN.
    old, lp, adv, mask, _ = make_batch(5, 12, seed=4, dtype=torch.float64)
    old[1, 3] = float("nan")  # row 1 is fully masked
    loss, _ = fused_ppo_loss(old, lp, adv, mask, mode, backend="torch")
    ref_loss, _ = naive_ppo_loss(old, lp, adv, mask, mode)
    assert not torch.isnan(loss) and loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
    mask[3, 4] = 0.0
    old[3, 4] = float("nan")  # a masked token of a row that has tokens
    loss, _ = fused_ppo_loss(old, lp, adv, mask, mode, backend="torch")
    ref_loss, _ = naive_ppo_loss(old, lp, adv, mask, mode)
    assert torch.isnan(loss).item() == torch.isnan(ref_loss).item() == mode.startswith("seq")
    if not mode.startswith("seq"):
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
