"""fused_linear_ppo_loss (torch backend) vs the reference path in float64: naive log-probs/entropy with autograd,
then core_algos' vanilla policy loss, entropy and KL terms aggregated by agg_loss with global batch info; loss,
d(hidden), d(weight) and metrics, for every aggregation mode and KL estimator. Also: the closed-form token
gradients against autograd (ties included), on-policy old log-probs, memory, matmul FLOPs (6·N·V·H against the
log-prob op's 8), grad_output scaling and input errors. Triton runs the same comparison in test_kernels_triton.py,
TP=2 in test_kernels_tp.py."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mppo.core_algos import (AGG_LOSS_MODES, KL_PENALTY_TYPES, GlobalBatchInfo, PolicyLossParams, agg_loss,
                             agg_token_weights, compute_policy_loss_vanilla, kl_penalty)
from mppo.kernels import STAT_NAMES, PPOTokenLoss, fused_linear_logprob_entropy, fused_linear_ppo_loss
from mppo.kernels.ppo_token_loss import token_terms
from mppo.kernels.reference import naive_linear_logprob_entropy

GLOBAL_INFO = GlobalBatchInfo(dp_size=4, batch_num_tokens=613, global_batch_size=24, loss_scale_factor=512.0)


@dataclass
class Problem:
    """A micro-batch [b, T] with N = valid.sum() response tokens, their hidden states and the LM head."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    labels: torch.Tensor  # [N]
    valid: torch.Tensor  # [b, T] bool: positions that have a token (the kernel's rows, row-major)
    mask: torch.Tensor  # [b, T] response mask (subset of valid; a fractional value; a fully masked row)
    advantages: torch.Tensor
    old_log_prob: torch.Tensor
    ref_log_prob: torch.Tensor
    rollout_is_weights: torch.Tensor


def make_problem(b=6, t=9, h=16, vocab=70, *, valid_vocab=None, seed=0, dtype=torch.float32,
                 temperature=1.0) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(b, t, generator=gen) > 0.2
    valid[:, 0] = True
    mask = (valid & (torch.rand(b, t, generator=gen) > 0.15)).to(torch.float64)
    if b > 2:
        mask[1] = 0.0  # a row without response tokens in the loss
        mask[2, 0] = 0.5
    n = int(valid.sum())
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, h, generator=gen, dtype=torch.float64) * 0.5
    labels = torch.randint(0, valid_vocab or vocab, (n,), generator=gen)
    with torch.no_grad():  # old / ref log-probs near the current ones: ratios inside and outside the clip range
        lp, _ = naive_linear_logprob_entropy(hidden, weight, labels, temperature=temperature,
                                             valid_vocab_size=valid_vocab)
    grid = torch.zeros(b, t, dtype=torch.float64).masked_scatter(valid, lp)
    old = torch.where(valid, grid + 0.4 * torch.randn(b, t, generator=gen, dtype=torch.float64), 0.0)
    ref = torch.where(valid, grid + 0.5 * torch.randn(b, t, generator=gen, dtype=torch.float64), 0.0)
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    adv[0, 0] = 0.0
    isw = torch.rand(b, t, generator=gen, dtype=torch.float64) + 0.5
    return Problem(hidden.to(dtype), weight.to(dtype), labels, valid, mask, adv, old, ref, isw)


@dataclass
class Knobs:
    mode: str = "token-mean"
    info: GlobalBatchInfo = GlobalBatchInfo()
    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0
    entropy_coeff: float = 0.01
    kl_coef: float = 0.1
    kl_type: str = "low_var_kl"
    with_isw: bool = True
    on_policy: bool = False
    temperature: float = 1.0
    valid_vocab: int | None = None


def reference(p: Problem, k: Knobs):
    """(loss, stats [6], log_probs, entropy, grad_hidden, grad_weight) of the reference path, in float64."""
    h = p.hidden.detach().double().clone().requires_grad_()
    w = p.weight.detach().double().clone().requires_grad_()
    lp, ent = naive_linear_logprob_entropy(h, w, p.labels, temperature=k.temperature,
                                           valid_vocab_size=k.valid_vocab)
    grid = lambda x: torch.zeros(p.valid.shape, dtype=torch.float64).masked_scatter(p.valid, x)  # noqa: E731
    lp_grid, ent_grid = grid(lp), grid(ent)
    old = lp_grid.detach() if k.on_policy else p.old_log_prob
    params = PolicyLossParams(clip_ratio_low=k.clip_low, clip_ratio_high=k.clip_high, clip_ratio_c=k.clip_c)
    pg_loss, metrics = compute_policy_loss_vanilla(old, lp_grid, p.advantages, p.mask, k.mode, config=params,
                                                   rollout_is_weights=p.rollout_is_weights if k.with_isw else None,
                                                   batch_info=k.info)
    entropy_loss = agg_loss(ent_grid, p.mask, k.mode, **k.info.as_kwargs())
    loss = pg_loss - k.entropy_coeff * entropy_loss if k.entropy_coeff else pg_loss
    kl_loss = torch.zeros((), dtype=torch.float64)
    if k.kl_coef:
        kl_loss = agg_loss(kl_penalty(lp_grid, p.ref_log_prob, k.kl_type), p.mask, k.mode, **k.info.as_kwargs())
        loss = loss + k.kl_coef * kl_loss
    loss.backward()
    stats = torch.tensor([pg_loss.item(), entropy_loss.item(), kl_loss.item(), metrics["actor/pg_clipfrac"],
                          metrics["actor/ppo_kl"], metrics["actor/pg_clipfrac_lower"]], dtype=torch.float64)
    return loss.detach(), stats, lp.detach(), ent.detach(), h.grad, w.grad


def spec_for(p: Problem, k: Knobs) -> PPOTokenLoss:
    weights = agg_token_weights(p.mask, k.mode, **k.info.as_kwargs())
    return PPOTokenLoss(advantages=p.advantages[p.valid], weights=weights[p.valid], mask=p.mask[p.valid],
                        old_log_prob=None if k.on_policy else p.old_log_prob[p.valid],
                        rollout_is_weights=p.rollout_is_weights[p.valid] if k.with_isw else None,
                        ref_log_prob=p.ref_log_prob[p.valid], clip_ratio_low=k.clip_low, clip_ratio_high=k.clip_high,
                        clip_ratio_c=k.clip_c, entropy_coeff=k.entropy_coeff, kl_loss_coef=k.kl_coef,
                        kl_loss_type=k.kl_type)


def fused(p: Problem, k: Knobs, *, backend="torch", chunk_rows=None, block_cols=None, device="cpu"):
    h = p.hidden.detach().to(device).clone().requires_grad_()
    w = p.weight.detach().to(device).clone().requires_grad_()
    spec = spec_for(p, k)
    spec = PPOTokenLoss(**{f: (v.to(device) if isinstance(v, torch.Tensor) else v) for f, v in vars(spec).items()})
    out = fused_linear_ppo_loss(h, w, p.labels.to(device), spec, temperature=k.temperature,
                                valid_vocab_size=k.valid_vocab, chunk_rows=chunk_rows, block_cols=block_cols,
                                backend=backend)
    out.loss.backward()
    return out.loss.detach(), out.stats, out.log_probs, out.entropy, h.grad, w.grad


def assert_matches(got, ref, *, rtol, grad_rtol=None):
    """Loss, stats, log-probs and entropy within rtol, gradients within grad_rtol, each relative to the
    reference's largest magnitude."""
    names = ("loss", "stats", "log_probs", "entropy", "grad_hidden", "grad_weight")
    for name, a, b in zip(names, got, ref):
        tol = grad_rtol if name.startswith("grad") and grad_rtol is not None else rtol
        scale = b.abs().max().item() + 1e-12
        err = (a.detach().cpu().double() - b).abs().max().item() / scale
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
@pytest.mark.parametrize("info", [GlobalBatchInfo(), GLOBAL_INFO], ids=["local", "global"])
def test_every_agg_mode_matches_the_reference_path_in_float64(mode, info):
    p = make_problem(dtype=torch.float64, valid_vocab=61, temperature=0.7)
    k = Knobs(mode=mode, info=info, temperature=0.7, valid_vocab=61)
    got = fused(p, k, chunk_rows=7, block_cols=16)  # several row chunks and vocab blocks, partial ones too
    ref = reference(p, k)
    assert_matches(got, ref, rtol=1e-11)
    assert got[0].dtype == torch.float64 and got[4].dtype == torch.float64


@pytest.mark.parametrize("kl_type", KL_PENALTY_TYPES)
def test_every_kl_estimator(kl_type):
    p = make_problem(dtype=torch.float64, seed=1)
    k = Knobs(kl_type=kl_type, kl_coef=0.5, entropy_coeff=0.0, with_isw=False)
    assert_matches(fused(p, k, chunk_rows=16), reference(p, k), rtol=1e-11)


@pytest.mark.parametrize("knobs", [
    Knobs(entropy_coeff=0.0, kl_coef=0.0, with_isw=False),  # plain clipped PPO
    Knobs(mode="seq-mean-token-sum", clip_low=0.1, clip_high=0.1, clip_c=1.5),  # dual clip often active
    Knobs(on_policy=True),  # old log-probs from this forward: ratio exactly 1
], ids=["pg_only", "tight_clip", "on_policy"])
def test_loss_variants_in_float64(knobs):
    p = make_problem(dtype=torch.float64, seed=2, b=4, t=12)
    got = fused(p, knobs, chunk_rows=10, block_cols=32)
    assert_matches(got, reference(p, knobs), rtol=1e-11)
    stats = dict(zip(STAT_NAMES, got[1].tolist()))
    if knobs.on_policy:
        assert stats["ppo_kl"] == 0.0 and stats["pg_clipfrac"] == 0.0
    if knobs.clip_c == 1.5:
        assert stats["pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("dtype,rtol,grad_rtol", [(torch.float32, 2e-5, 2e-5), (torch.bfloat16, 1e-5, 2e-2)])
def test_float32_and_bfloat16_inputs(dtype, rtol, grad_rtol):
    # statistics and the loss are fp32 of the exact 16-bit values; gradients are rounded to the input dtype
    p = make_problem(dtype=dtype, seed=3, b=8, t=10, h=24, vocab=130)
    k = Knobs(mode="seq-mean-token-mean", info=GLOBAL_INFO, temperature=0.9)
    got = fused(p, k, chunk_rows=11, block_cols=40)
    assert got[0].dtype == torch.float32 and got[4].dtype == dtype and got[5].dtype == dtype
    ref_problem = Problem(**{**vars(p), "hidden": p.hidden.double(), "weight": p.weight.double()})
    assert_matches(got, reference(ref_problem, k), rtol=rtol, grad_rtol=grad_rtol)


def test_default_chunk_plan_and_one_token():
    p = make_problem(dtype=torch.float64, seed=4)
    assert_matches(fused(p, Knobs()), reference(p, Knobs()), rtol=1e-11)
    one = make_problem(b=1, t=1, dtype=torch.float64, seed=5)
    one.mask[:] = 1.0
    assert_matches(fused(one, Knobs()), reference(one, Knobs()), rtol=1e-11)


def test_closed_form_token_gradients_equal_autograd_at_ties():
    # ratio exactly on a clip bound, exactly at clip_ratio_c with A < 0, log-ratio exactly ±20 and beyond, A = 0;
    # KL clamps hit exactly (ref − logp = ±20, k3 estimate = 10) — where torch's tie rules decide the gradient
    c = torch.exp(torch.tensor(1.25, dtype=torch.float64)).item()
    lp = torch.tensor([0.0, 1.25, 20.0, -20.0, 0.3, 0.0, 25.0, -30.0, 0.1823215567939546, -0.2231435513142097],
                      dtype=torch.float64)
    old = torch.zeros_like(lp)
    adv = torch.tensor([1.0, -2.0, -1.0, 1.0, 0.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    ref = lp.clone()
    ref[0], ref[1], ref[2] = 20.0, 1.25 - 20.0, 20.0 - 20.0
    weights = torch.linspace(0.5, 1.5, len(lp), dtype=torch.float64)
    for low, high in [(0.0, 0.0), (0.2, 0.2)]:  # exp(0.18232..) = 1.2 and exp(−0.22314..) = 0.8 are bounds
        for kl_type in ("low_var_kl", "k3+", "abs", "k1"):
            spec = PPOTokenLoss(advantages=adv, weights=weights, mask=torch.ones_like(lp), old_log_prob=old,
                                ref_log_prob=ref, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                                kl_loss_coef=0.3, kl_loss_type=kl_type)
            terms = token_terms(spec, 0, len(lp), lp, torch.zeros_like(lp))
            x = lp.clone().requires_grad_()
            params = PolicyLossParams(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
            pg, _ = compute_policy_loss_vanilla(old[None], x[None], adv[None], torch.ones(1, len(lp)), "token-sum",
                                                config=params, rollout_is_weights=weights[None])
            kl = (kl_penalty(x, ref, kl_type) * weights).sum()
            (pg + 0.3 * kl).backward()
            torch.testing.assert_close(terms.g_log_prob, x.grad, rtol=1e-12, atol=1e-14)
            assert (terms.pg * weights).sum().item() == pytest.approx(pg.item(), rel=1e-12)


class _MatmulFlops(TorchDispatchMode):
    """Counts 2·m·n·k per matrix product and records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.flops, self.largest = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in ("mm", "addmm", "addmm_"):
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_six_nvh_flops_and_one_chunk_of_logits():
    h, v, rows = 8, 2048, 16
    p = make_problem(b=8, t=8, h=h, vocab=v, seed=6)
    n = p.hidden.shape[0]
    with _MatmulFlops() as fused_probe:
        fused(p, Knobs(), chunk_rows=rows)
    with _MatmulFlops() as recompute_probe:
        hid = p.hidden.clone().requires_grad_()
        w = p.weight.clone().requires_grad_()
        lp, ent = fused_linear_logprob_entropy(hid, w, p.labels, backend="torch")
        (lp.sum() + ent.sum()).backward()
    assert fused_probe.flops == 6 * n * v * h
    assert recompute_probe.flops == 8 * n * v * h
    assert fused_probe.largest <= max(rows * v, v * h)  # one row chunk of logits, or the weight's gradient


def test_backward_scales_by_grad_output_and_frozen_weight():
    p = make_problem(seed=7)
    h = p.hidden.clone().requires_grad_()
    w = p.weight.clone().requires_grad_()
    out = fused_linear_ppo_loss(h, w, p.labels, spec_for(p, Knobs()), backend="torch")
    (out.loss * 3.0).backward()
    ref = fused(p, Knobs())
    torch.testing.assert_close(h.grad, 3.0 * ref[4])
    torch.testing.assert_close(w.grad, 3.0 * ref[5])
    h = p.hidden.clone().requires_grad_()
    out = fused_linear_ppo_loss(h, p.weight, p.labels, spec_for(p, Knobs()), backend="torch")
    out.loss.backward()
    torch.testing.assert_close(h.grad, ref[4])
    assert out.log_probs.grad_fn is None and out.stats.grad_fn is None


def test_no_grad_gives_the_values_and_no_graph():
    p = make_problem(seed=8)
    with torch.no_grad():
        out = fused_linear_ppo_loss(p.hidden.clone().requires_grad_(), p.weight, p.labels, spec_for(p, Knobs()),
                                    backend="torch")
    ref = fused(p, Knobs())
    assert out.loss.grad_fn is None
    assert out.loss.item() == pytest.approx(ref[0].item(), rel=1e-6)
    torch.testing.assert_close(out.stats, ref[1])


def test_no_tokens():
    p = make_problem(seed=9)
    h = torch.zeros(0, p.hidden.shape[1], requires_grad=True)
    empty = torch.zeros(0)
    spec = PPOTokenLoss(advantages=empty, weights=empty, mask=empty, old_log_prob=empty, ref_log_prob=empty,
                        kl_loss_coef=0.1)
    out = fused_linear_ppo_loss(h, p.weight, p.labels[:0], spec, backend="torch")
    out.loss.backward()
    assert out.loss.item() == 0.0 and h.grad.shape == (0, p.hidden.shape[1])


@pytest.mark.parametrize("change,error,match", [
    (dict(advantages=torch.zeros(3)), ValueError, "advantages must be"),
    (dict(advantages=torch.zeros(0).requires_grad_()), ValueError, "requires grad"),
    (dict(clip_ratio_c=1.0), ValueError, "clip_ratio_c"),
    (dict(ref_log_prob=None, kl_loss_coef=0.1), ValueError, "needs ref_log_prob"),
    (dict(kl_loss_type="full", kl_loss_coef=0.1), ValueError, "kl_loss_type must be one of"),
])
def test_bad_specs(change, error, match):
    p = make_problem(seed=10)
    spec = spec_for(p, Knobs())
    if "advantages" in change and change["advantages"].requires_grad:
        change = dict(advantages=spec.advantages.clone().requires_grad_())
    spec = PPOTokenLoss(**{**vars(spec), **change})
    with pytest.raises(error, match=match):
        fused_linear_ppo_loss(p.hidden, p.weight, p.labels, spec, backend="torch")


@pytest.mark.parametrize("kwargs,match", [
    (dict(chunk_rows=0), "chunk_rows"), (dict(block_cols=0), "block_cols"), (dict(backend="naive"), "no naive"),
    (dict(temperature=0.0), "temperature"), (dict(valid_vocab_size=3), "labels must be global token ids"),
])
def test_bad_arguments(kwargs, match):
    p = make_problem(seed=11)
    with pytest.raises(ValueError, match=match):
        fused_linear_ppo_loss(p.hidden, p.weight, p.labels, spec_for(p, Knobs()), **{"backend": "torch", **kwargs})
