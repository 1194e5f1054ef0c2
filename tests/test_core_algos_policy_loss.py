"""Policy, value and entropy losses of mppo.core_algos against per-token Python loops (float64), gradients against
the hand-derived formulas of ppo_math.md section 5 or finite differences, split invariance and veRL quirks."""
from __future__ import annotations

import math

import pytest
import torch

from mppo.core_algos import (
    AGG_LOSS_MODES,
    POLICY_LOSS_REGISTRY,
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    get_policy_loss_fn,
)

BS, T = 5, 6


def _batch(seed: int, spread: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(BS, T, generator=g, dtype=torch.float64) * 3 - 0.05
    log_prob = (old + spread * torch.randn(BS, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(BS, T, generator=g, dtype=torch.float64)
    mask = torch.ones(BS, T, dtype=torch.float64)
    mask[1, 4:] = 0
    mask[2, 1] = 0
    mask[4] = 0  # a fully-masked row
    mask[4, 0] = 0
    return old, log_prob, adv, mask


def _agg(L, m, mode):
    """Reference aggregation (single rank, no global info)."""
    rows = [(sum(l * k for l, k in zip(Lr, mr) if k), sum(mr)) for Lr, mr in zip(L, m)]
    if mode == "token-mean":
        return sum(s for s, _ in rows) / sum(n for _, n in rows)
    if mode == "token-sum":
        return sum(s for s, _ in rows)
    kept = [(s, n) for s, n in rows if n > 0]
    if mode == "seq-mean-token-mean":
        return sum(s / (n + 1e-8) for s, n in kept) / len(kept)
    loss = sum(s for s, _ in kept) / len(kept)
    return loss / len(L[0]) if mode == "seq-mean-token-sum-norm" else loss


def _token_weights(m, mode):
    """d(aggregated loss) / d(L[i][t]) for the reference aggregation."""
    n_tok = sum(map(sum, m))
    kept = sum(1 for r in m if sum(r) > 0)
    w = []
    for r in m:
        n = sum(r)
        if mode == "token-mean":
            w.append([k / n_tok for k in r])
        elif mode == "token-sum":
            w.append(list(r))
        elif mode == "seq-mean-token-mean":
            w.append([k / (n + 1e-8) / kept if n else 0.0 for k in r])
        else:
            w.append([k / kept / (len(r) if mode == "seq-mean-token-sum-norm" else 1) for k in r])
    return w


def _mmean(vals, m):
    return sum(v * k for vr, mr in zip(vals, m) for v, k in zip(vr, mr) if k) / (sum(map(sum, m)) + 1e-8)


def _lists(*tensors):
    return [t.tolist() for t in tensors]


def _run(mode, old, lp, adv, mask, agg="token-mean", **kw):
    lp = lp.clone().requires_grad_(True)
    loss, metrics = compute_policy_loss(old, lp, adv, mask, agg, loss_mode=mode, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.item(), metrics, grad


# ---------------------------------------------------------------- vanilla
def _vanilla_ref(old, lp, adv, m, low, high, c, agg):
    L, g_factor, clipfrac, kl, lower = [], [], [], [], []
    for i in range(len(old)):
        Lr, gr, cr, kr, lr_ = [], [], [], [], []
        for t in range(len(old[0])):
            a = adv[i][t]
            raw = lp[i][t] - old[i][t]
            log_ratio = min(max(raw, -20.0), 20.0)
            r = math.exp(log_ratio)
            l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
            c1 = max(l1, l2)
            l3 = -a * c
            loss = min(l3, c1) if a < 0 else c1
            Lr.append(loss)
            # l1 is active if the ratio is inside the clip range (then l1 == l2, same gradient) or l1 > l2
            unclipped = (1 - low < r < 1 + high or l1 > l2) and not (a < 0 and l3 < c1) and abs(raw) < 20
            gr.append(-a * r if unclipped else 0.0)  # d loss / d log_prob
            cr.append(float(l2 > l1))
            kr.append(-log_ratio)
            lr_.append(float(c1 > l3 and a < 0))
        L.append(Lr), g_factor.append(gr), clipfrac.append(cr), kl.append(kr), lower.append(lr_)
    w = _token_weights(m, agg)
    grad = [[g * wt for g, wt in zip(gr, wr)] for gr, wr in zip(g_factor, w)]
    metrics = {"actor/pg_clipfrac": _mmean(clipfrac, m), "actor/ppo_kl": _mmean(kl, m),
               "actor/pg_clipfrac_lower": _mmean(lower, m)}
    return _agg(L, m, agg), metrics, grad, L


@pytest.mark.parametrize("agg", AGG_LOSS_MODES)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.1, 0.28, 1.5)])
def test_vanilla_value_metrics_and_gradient(agg, low, high, c):
    old, lp, adv, mask = _batch(0, spread=0.8)
    lp[0, 0] = old[0, 0] + 25.0  # beyond the +-20 clamp
    loss, metrics, grad = _run("vanilla", old, lp, adv, mask, agg, clip_ratio_low=low, clip_ratio_high=high,
                               clip_ratio_c=c)
    e_loss, e_metrics, e_grad, _ = _vanilla_ref(*_lists(old, lp, adv, mask), low, high, c, agg)
    assert loss == pytest.approx(e_loss, rel=1e-10)
    assert metrics.keys() == e_metrics.keys()
    for k in metrics:
        assert type(metrics[k]) is float
        assert metrics[k] == pytest.approx(e_metrics[k], rel=1e-10, abs=1e-12), k
    torch.testing.assert_close(grad, torch.tensor(e_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def test_quirk_dual_clip_only_for_negative_advantage_and_clamped_ppo_kl():
    old = torch.zeros(1, 4, dtype=torch.float64)
    lp = torch.tensor([[math.log(5.0), math.log(5.0), 25.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0, -2.0, 0.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, metrics, grad = _run("vanilla", old, lp, adv, mask, "token-sum")
    # A=-1, ratio 5: standard clip gives max(5, 1.2) = 5; dual clip caps it at 3.
    # A=+1, ratio 5: -1.2 (clipped). A=-2, ratio e^20: dual clip 6. A=0: 0 (standard branch).
    assert loss == pytest.approx(3.0 - 1.2 + 6.0, rel=1e-12)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(2 / 4, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 4, rel=1e-6)  # only the A=+1 token: l2 > l1 strictly
    assert metrics["actor/ppo_kl"] == pytest.approx(-(2 * math.log(5.0) + 20.0) / 4, rel=1e-6)  # 25 clamped to 20
    assert grad.abs().sum().item() == 0.0  # every token is clipped: no gradient


def test_vanilla_rollout_is_weights_multiply_token_losses():
    old, lp, adv, mask = _batch(1)
    w = torch.rand(BS, T, dtype=torch.float64) + 0.5
    loss_w, _, grad_w = _run("vanilla", old, lp, adv, mask, "seq-mean-token-mean", rollout_is_weights=w)
    _, _, e_grad, L = _vanilla_ref(*_lists(old, lp, adv, mask), 0.2, 0.2, 3.0, "seq-mean-token-mean")
    weighted = (torch.tensor(L, dtype=torch.float64) * w).tolist()
    assert loss_w == pytest.approx(_agg(weighted, mask.tolist(), "seq-mean-token-mean"), rel=1e-10)
    torch.testing.assert_close(grad_w, torch.tensor(e_grad, dtype=torch.float64) * w, rtol=1e-9, atol=1e-12)


# ---------------------------------------------------------------- the other modes: value references
def _ratio(o, p, clamp=True):
    x = p - o
    return math.exp(min(max(x, -20.0), 20.0) if clamp else x)


def _token_loss_ref(mode, old, lp, adv, m, kn):
    """Per-token losses for the modes whose token loss depends only on the token (plus gspo's row ratio)."""
    low, high = kn.get("clip_ratio_low", 0.2), kn.get("clip_ratio_high", 0.2)
    out = []
    for i in range(len(old)):
        row = []
        n = max(sum(m[i]), 1)
        seq_lr = sum((lp[i][t] - old[i][t]) * m[i][t] for t in range(len(old[0]))) / n
        for t in range(len(old[0])):
            o, p, a = old[i][t], lp[i][t], adv[i][t]
            if mode == "gpg":
                row.append(-p * a)
            elif mode == "dro":
                row.append(-(p * a - 0.5 * kn["dro_beta"] * (p - o) ** 2))
            elif mode == "cispo":
                row.append(-min(max(_ratio(o, p), 1 - low), 1 + high) * a * p)
            elif mode == "sapo":
                tau = kn.get("tau_pos", 1.0) if a > 0 else kn.get("tau_neg", 1.05)
                gate = 1 / (1 + math.exp(-tau * (_ratio(o, p) - 1))) * 4 / tau
                row.append(-gate * a)
            elif mode == "gspo":
                r = math.exp(min(seq_lr, 10.0))
                row.append(max(-a * r, -a * min(max(r, 1 - low), 1 + high)))
            elif mode in ("dppo_tv", "dppo_kl"):
                prob, old_prob = math.exp(p), math.exp(o)
                if mode == "dppo_tv":
                    valid = prob - old_prob <= high if a > 0 else prob - old_prob >= -low
                else:
                    bkl = old_prob * (o - p) + (1 - old_prob) * math.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
                    valid = (bkl <= high or prob <= old_prob) if a > 0 else (bkl <= low or prob >= old_prob)
                row.append(-a * min(_ratio(o, p), kn.get("clip_ratio_c", 3.0)) * p * float(valid))
        out.append(row)
    return out


def _token_grad_ref(mode, old, lp, adv, m, kn):
    """Hand-derived d(token loss)/d(log_prob) where a stop-gradient makes finite differences inapplicable."""
    low, high = kn.get("clip_ratio_low", 0.2), kn.get("clip_ratio_high", 0.2)
    out = []
    for i in range(len(old)):
        row = []
        n = max(sum(m[i]), 1)
        seq_lr = sum((lp[i][t] - old[i][t]) * m[i][t] for t in range(len(old[0]))) / n
        for t in range(len(old[0])):
            o, p, a = old[i][t], lp[i][t], adv[i][t]
            if mode == "cispo":  # sg(clipped ratio): gradient through log_prob only, clipped tokens included
                row.append(-min(max(_ratio(o, p), 1 - low), 1 + high) * a)
            elif mode == "gspo":  # value s_i, gradient of log_prob; 0 where the clipped branch is active
                r = math.exp(seq_lr)
                active = 1 - low < r < 1 + high or -a * r > -a * min(max(r, 1 - low), 1 + high)
                row.append(-a * r if active else 0.0)
            else:  # dppo: sg(truncated ratio) * valid
                prob, old_prob = math.exp(p), math.exp(o)
                if mode == "dppo_tv":
                    valid = prob - old_prob <= high if a > 0 else prob - old_prob >= -low
                else:
                    bkl = old_prob * (o - p) + (1 - old_prob) * math.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
                    valid = (bkl <= high or prob <= old_prob) if a > 0 else (bkl <= low or prob >= old_prob)
                row.append(-a * min(_ratio(o, p), kn.get("clip_ratio_c", 3.0)) * float(valid))
        out.append(row)
    return out


KNOBS = {
    "gpg": {},
    "dro": {"dro_beta": 0.3},
    "cispo": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3},
    "sapo": {"tau_pos": 1.3, "tau_neg": 2.0},
    "gspo": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.08},
    "dppo_tv": {"clip_ratio_low": 0.05, "clip_ratio_high": 0.08},
    "dppo_kl": {"clip_ratio_low": 0.02, "clip_ratio_high": 0.03, "clip_ratio_c": 1.5},
}


@pytest.mark.parametrize("mode", sorted(KNOBS))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_token_modes_value_and_gradient(mode, agg):
    old, lp, adv, mask = _batch(2, spread=0.6)
    kn = KNOBS[mode]
    loss, metrics, grad = _run(mode, old, lp, adv, mask, agg, **kn)
    L = _token_loss_ref(mode, *_lists(old, lp, adv, mask), kn)
    effective_agg = "seq-mean-token-mean" if mode == "sapo" else agg  # SAPO ignores loss_agg_mode
    assert loss == pytest.approx(_agg(L, mask.tolist(), effective_agg), rel=1e-10)
    assert all(type(v) is float for v in metrics.values())

    w = torch.tensor(_token_weights(mask.tolist(), effective_agg), dtype=torch.float64)
    if mode in ("cispo", "gspo", "dppo_tv", "dppo_kl"):
        expected = torch.tensor(_token_grad_ref(mode, *_lists(old, lp, adv, mask), kn), dtype=torch.float64) * w
    else:  # no stop-gradient: central finite differences of the loss itself
        expected = torch.zeros_like(lp)
        h = 1e-6
        for i in range(BS):
            for t in range(T):
                up, down = lp.clone(), lp.clone()
                up[i, t] += h
                down[i, t] -= h
                f_up = compute_policy_loss(old, up, adv, mask, agg, loss_mode=mode, **kn)[0].item()
                f_down = compute_policy_loss(old, down, adv, mask, agg, loss_mode=mode, **kn)[0].item()
                expected[i, t] = (f_up - f_down) / (2 * h)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-8)


def test_token_mode_metrics():
    old, lp, adv, mask = _batch(3, spread=0.6)
    o, p, a, m = _lists(old, lp, adv, mask)
    kl = _mmean([[-(pp - oo) for oo, pp in zip(orow, prow)] for orow, prow in zip(o, p)], m)
    assert compute_policy_loss(old, lp, adv, mask, loss_mode="gpg")[1] == {}
    _, dro = compute_policy_loss(old, lp, adv, mask, loss_mode="dro", dro_beta=0.1)
    assert dro == pytest.approx({"actor/ppo_kl": kl})
    _, sapo = compute_policy_loss(old, lp, adv, mask, loss_mode="sapo")
    assert sapo == pytest.approx({"actor/pg_clipfrac": 0.0, "actor/ppo_kl": kl, "actor/pg_clipfrac_lower": 0.0})
    _, cispo = compute_policy_loss(old, lp, adv, mask, loss_mode="cispo", clip_ratio_low=0.1, clip_ratio_high=0.1)
    clipped = [[float(abs(math.exp(pp - oo) - 1) > 0.1) for oo, pp in zip(orow, prow)] for orow, prow in zip(o, p)]
    assert cispo == pytest.approx({"actor/pg_clipfrac": _mmean(clipped, m), "actor/ppo_kl": kl,
                                   "actor/pg_clipfrac_lower": 0.0})
    _, gspo = compute_policy_loss(old, lp, adv, mask, loss_mode="gspo")
    assert gspo["actor/ppo_kl"] == pytest.approx(kl) and gspo["actor/pg_clipfrac_lower"] == 0.0


# ---------------------------------------------------------------- geo_mean, kl_cov, clip_cov
def _geo_mean_ref(old, lp, adv, m, low, high):
    losses = []
    for o, p, a, mr in zip(old, lp, adv, m):
        n = sum(mr)
        s_lr, s_adv = 0.0, 0.0
        for oo, pp, aa, k in zip(o, p, a, mr):
            x = pp - oo
            xc = min(max(x, -low), high)
            pessimistic = min(x, xc) if aa > 0 else max(x, xc) if aa < 0 else 0.0
            s_lr += pessimistic * k
            s_adv += aa * k
        losses.append(-(s_adv / (n + 1e-8)) * math.exp(s_lr / (n + 1e-8)))
    return sum(losses) / len(losses)  # mean over ALL rows, fully-masked ones included


def test_geo_mean_value_gradient_and_quirks():
    old, lp, adv, mask = _batch(4, spread=0.3)
    kn = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15}
    ref = _geo_mean_ref(*_lists(old, lp, adv, mask), 0.1, 0.15)
    for agg in AGG_LOSS_MODES:  # loss_agg_mode is ignored
        loss, _, grad = _run("geo_mean", old, lp, adv, mask, agg, **kn)
        assert loss == pytest.approx(ref, rel=1e-10)
    h = 1e-6
    fd = torch.zeros_like(lp)
    for i in range(BS):
        for t in range(T):
            up, down = lp.clone(), lp.clone()
            up[i, t] += h
            down[i, t] -= h
            fd[i, t] = (_geo_mean_ref(*_lists(old, up, adv, mask), 0.1, 0.15)
                        - _geo_mean_ref(*_lists(old, down, adv, mask), 0.1, 0.15)) / (2 * h)
    torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-8)
    # mean over all rows: the fully-masked row 4 counts in the denominator
    kept, _, _ = _run("geo_mean", old[:4], lp[:4], adv[:4], mask[:4], **kn)
    assert loss == pytest.approx(kept * 4 / 5, rel=1e-10)


def test_kl_cov_penalises_top_covariance_tokens():
    old, lp, adv, mask = _batch(5, spread=0.5)
    ratio, coef = 0.25, 0.7
    loss, metrics, grad = _run("kl_cov", old, lp, adv, mask, "token-mean", kl_cov_ratio=ratio, ppo_kl_coef=coef)
    o, p, a, m = _lists(old, lp, adv, mask)
    valid = [(i, t) for i in range(BS) for t in range(T) if m[i][t]]
    mean_a = sum(a[i][t] for i, t in valid) / len(valid)
    mean_p = sum(p[i][t] for i, t in valid) / len(valid)
    cov = {(i, t): (a[i][t] - mean_a) * (p[i][t] - mean_p) for i, t in valid}
    top = set(sorted(valid, key=lambda k: -cov[k])[: max(1, int(len(valid) * ratio))])
    L = [[-a[i][t] * math.exp(p[i][t] - o[i][t]) + (coef * abs(p[i][t] - o[i][t]) if (i, t) in top else 0.0)
          for t in range(T)] for i in range(BS)]
    assert loss == pytest.approx(_agg(L, m, "token-mean"), rel=1e-10)
    n_tok = sum(map(sum, m))
    for i, t in valid:
        x = p[i][t] - o[i][t]
        expected = (-a[i][t] * math.exp(x) + (coef * math.copysign(1, x) if (i, t) in top else 0.0)) / n_tok
        assert grad[i, t].item() == pytest.approx(expected, rel=1e-9)
    assert metrics == pytest.approx({"actor/ppo_kl": _mmean([[abs(pp - oo) for oo, pp in zip(orow, prow)]
                                                             for orow, prow in zip(o, p)], m)})


def _clip_cov_candidates(o, p, a, m, low, high, lb, ub):
    valid = [(i, t) for i in range(BS) for t in range(T) if m[i][t]]
    n = sum(map(sum, m))
    mean_a = sum(a[i][t] for i, t in valid) / (n + 1e-8)
    mean_p = sum(p[i][t] for i, t in valid) / (n + 1e-8)
    out = []
    for i, t in valid:
        r = math.exp(p[i][t] - o[i][t])
        clipped = -a[i][t] * min(max(r, 1 - low), 1 + high) > -a[i][t] * r
        cov = (a[i][t] - mean_a) * (p[i][t] - mean_p)
        if not clipped and lb < cov < ub:
            out.append((i, t))
    return out


def test_clip_cov_drops_candidates_deterministic_when_all_are_dropped():
    old, lp, adv, mask = _batch(6, spread=0.5)
    adv = adv * 3
    kn = dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0)  # drop count >= #candidates: all dropped
    loss, metrics, grad = _run("clip_cov", old, lp, adv, mask, "token-mean", **kn)
    o, p, a, m = _lists(old, lp, adv, mask)
    dropped = set(_clip_cov_candidates(o, p, a, m, 0.2, 0.2, 0.05, 5.0))
    assert 0 < len(dropped) < sum(map(sum, m)) / 2
    L, G = [], []
    n_tok = sum(map(sum, m))
    for i in range(BS):
        Lr, Gr = [], []
        for t in range(T):
            r = math.exp(p[i][t] - o[i][t])
            l1, l2 = -a[i][t] * r, -a[i][t] * min(max(r, 0.8), 1.2)
            keep = 0.0 if (i, t) in dropped else 1.0
            Lr.append(max(l1, l2) * keep)  # no dual clip
            active = 0.8 < r < 1.2 or l1 > l2
            Gr.append((-a[i][t] * r if active else 0.0) * keep * m[i][t] / n_tok)
        L.append(Lr), G.append(Gr)
    assert loss == pytest.approx(_agg(L, m, "token-mean"), rel=1e-10)
    torch.testing.assert_close(grad, torch.tensor(G, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(len(dropped) / (n_tok + 1e-8))
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl"}


def test_clip_cov_random_subset_is_seeded_and_from_candidates():
    old, lp, adv, mask = _batch(6, spread=0.5)
    adv = adv * 3
    kn = dict(clip_cov_ratio=0.05, clip_cov_lb=0.05, clip_cov_ub=5.0)  # int(0.05 * 23) = 1 token dropped
    candidates = set(_clip_cov_candidates(*_lists(old, lp, adv, mask), 0.2, 0.2, 0.05, 5.0))
    full_loss = compute_policy_loss(old, lp, adv, mask, loss_mode="vanilla", clip_ratio_c=1e9)[0].item()
    results = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        loss, metrics, grad = _run("clip_cov", old, lp, adv, mask, **kn)
        zero_grad = {(i, t) for i in range(BS) for t in range(T) if mask[i, t] and grad[i, t] == 0}
        assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / mask.sum().item())
        results.append((loss, zero_grad & candidates))
        assert len(zero_grad & candidates) == 1
        assert loss != full_loss
    assert results[0] == results[1]  # same seed, same dropped token


def test_quirk_coupled_modes_do_not_clamp_log_ratio():
    old = torch.zeros(2, 2, dtype=torch.float64)
    lp = torch.tensor([[25.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 0.5], [0.5, -0.5]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.float64)
    _, vanilla = compute_policy_loss(old, lp, adv, mask)
    assert vanilla["actor/ppo_kl"] == pytest.approx(-20 / 4)  # clamped
    for mode in ("gspo", "clip_cov", "kl_cov", "geo_mean"):
        _, metrics = compute_policy_loss(old, lp, adv, mask, loss_mode=mode)
        assert metrics["actor/ppo_kl"] == pytest.approx((-25 / 4) if mode != "kl_cov" else 25 / 4), mode
    # clip_cov keeps the unclamped ratio e^25 in the loss (no dual clip): token (0, 0) alone is 1 * e^25.
    # Token (1, 1) has covariance (-0.5 + 0.125) * (0 - 6.25) = 2.34 in (1, 5), so it is the one dropped token.
    loss, _ = compute_policy_loss(old, lp, adv, mask, "token-sum", loss_mode="clip_cov")
    assert loss.item() == pytest.approx(math.exp(25) + (-0.5) + (-0.5), rel=1e-12)


# ---------------------------------------------------------------- split invariance, registry, errors
# geo_mean ignores the global batch info and kl_cov / clip_cov pick tokens per call (as in veRL), so a split
# changes those three by design; every other mode must be split-invariant.
SPLIT_MODES = ["vanilla", "gspo", "sapo", "gpg", "cispo", "dro", "dppo_tv", "dppo_kl"]


@pytest.mark.parametrize("agg", AGG_LOSS_MODES)
def test_policy_loss_split_into_dp_and_micro_batches_equals_full_batch(agg):
    old, lp, adv, mask = _batch(7)
    for mode in SPLIT_MODES:
        full_lp = lp.clone().requires_grad_(True)
        full, _ = compute_policy_loss(old, full_lp, adv, mask, agg, loss_mode=mode, dro_beta=0.2)
        (full_grad,) = torch.autograd.grad(full, full_lp)
        split_lp = lp.clone().requires_grad_(True)
        info = dict(dp_size=2, batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(-1) > 0).sum()))
        total = 0.0
        for rows in ([0, 3], [1], [4, 2]):  # rank 0: [0, 3] and [1]; rank 1: [4, 2]
            loss, _ = compute_policy_loss(old[rows], split_lp[rows], adv[rows], mask[rows], agg, loss_mode=mode,
                                          dro_beta=0.2, **info)
            total = total + loss
        split = total / 2  # DDP averages the two ranks' gradients
        (split_grad,) = torch.autograd.grad(split, split_lp)
        assert split.item() == pytest.approx(full.item(), rel=1e-10), mode
        torch.testing.assert_close(split_grad, full_grad, rtol=1e-10, atol=1e-13, msg=mode)


def test_registry_and_errors():
    expected = {"vanilla", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo", "dppo_tv",
                "dppo_kl"}
    assert expected <= set(POLICY_LOSS_REGISTRY)
    assert get_policy_loss_fn("vanilla") is POLICY_LOSS_REGISTRY["vanilla"]
    old, lp, adv, mask = _batch(8)
    with pytest.raises(ValueError, match="valid modes.*vanilla"):
        compute_policy_loss(old, lp, adv, mask, loss_mode="ppo2")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss(old, lp, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="dro_beta"):
        compute_policy_loss(old, lp, adv, mask, loss_mode="dro")
    with pytest.raises(TypeError, match="tau_pos"):
        compute_policy_loss(old, lp, adv, mask, loss_mode="sapo", tau_positive=1.0)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        compute_policy_loss(old, lp, adv, mask, dp_size=2)
    with pytest.raises(ValueError, match="valid modes"):
        compute_policy_loss(old, lp, adv, mask, "mean")


def test_clip_ratio_none_falls_back_to_clip_ratio():
    old, lp, adv, mask = _batch(9, spread=0.8)
    a = compute_policy_loss(old, lp, adv, mask, clip_ratio_low=None, clip_ratio_high=None, clip_ratio=0.1)[0]
    b = compute_policy_loss(old, lp, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)[0]
    assert a.item() == b.item()


# ---------------------------------------------------------------- value and entropy losses
@pytest.mark.parametrize("agg", AGG_LOSS_MODES)
def test_value_loss_against_loops(agg):
    g = torch.Generator().manual_seed(10)
    vpreds = torch.randn(BS, T, generator=g, dtype=torch.float64).requires_grad_(True)
    values = vpreds.detach() + 0.8 * torch.randn(BS, T, generator=g, dtype=torch.float64)
    returns = torch.randn(BS, T, generator=g, dtype=torch.float64)
    _, _, _, mask = _batch(10)
    loss, clipfrac = compute_value_loss(vpreds, returns, values, mask, 0.5, agg)
    (grad,) = torch.autograd.grad(loss, vpreds)
    vp, v, R, m = _lists(vpreds.detach(), values, returns, mask)
    L, gfac, clipped = [], [], []
    for i in range(BS):
        Lr, Gr, Cr = [], [], []
        for t in range(T):
            vc = min(max(vp[i][t], v[i][t] - 0.5), v[i][t] + 0.5)
            l1, l2 = (vp[i][t] - R[i][t]) ** 2, (vc - R[i][t]) ** 2
            Lr.append(max(l1, l2))
            # clipped branch active: vpc is constant wrt vpreds outside [v-c, v+c]
            Gr.append(0.5 * (2 * (vp[i][t] - R[i][t]) if l1 > l2 else (2 * (vc - R[i][t]) if vc == vp[i][t] else 0.0)))
            Cr.append(float(l2 > l1))
        L.append(Lr), gfac.append(Gr), clipped.append(Cr)
    assert loss.item() == pytest.approx(0.5 * _agg(L, m, agg), rel=1e-10)
    assert clipfrac.item() == pytest.approx(_mmean(clipped, m), rel=1e-10)
    w = _token_weights(m, agg)
    torch.testing.assert_close(grad, torch.tensor(gfac, dtype=torch.float64) * torch.tensor(w, dtype=torch.float64),
                               rtol=1e-9, atol=1e-12)
    info = dict(dp_size=2, batch_num_tokens=7, global_batch_size=3, loss_scale_factor=4)
    scaled, _ = compute_value_loss(vpreds, returns, values, mask, 0.5, agg, **info)
    expected = {"token-mean": 2 / 7 * _agg(L, m, "token-sum"), "token-sum": 2 * _agg(L, m, "token-sum")}
    seq_sum = sum(sum(l * k for l, k in zip(Lr, mr)) for Lr, mr in zip(L, m))
    seq_mean = sum(sum(l * k for l, k in zip(Lr, mr)) / (sum(mr) + 1e-8) for Lr, mr in zip(L, m) if sum(mr))
    expected.update({"seq-mean-token-sum": 2 / 3 * seq_sum, "seq-mean-token-sum-norm": 2 / 3 * seq_sum / 4,
                     "seq-mean-token-mean": 2 / 3 * seq_mean})
    assert scaled.item() == pytest.approx(0.5 * expected[agg], rel=1e-10)


def test_entropy_loss():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(BS, T, 4, generator=g, dtype=torch.float64)
    _, _, _, mask = _batch(11)
    ent = []
    for i in range(BS):
        row = []
        for t in range(T):
            z = [math.exp(x) for x in logits[i, t].tolist()]
            row.append(-sum(q / sum(z) * math.log(q / sum(z)) for q in z))
        ent.append(row)
    for agg in AGG_LOSS_MODES:
        got = compute_entropy_loss(logits, mask, agg).item()
        assert got == pytest.approx(_agg(ent, mask.tolist(), agg), rel=1e-10)
