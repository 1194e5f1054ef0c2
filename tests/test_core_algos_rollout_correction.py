"""Rollout correction (veRL 0.9.1 rollout_corr_helper semantics) against independent plain-Python references.

The references below are written from the semantics (module docstring of mppo.core_algos.rollout_correction and
veRL's), one token at a time in float64, and share no code with mppo. Inputs are float64 so that the comparison
can be tight. Edge cases: log-ratios past +-20, masks with holes, empty and one-token rows, IcePop bounds, every
rollout_rs option and chains of them, batch normalisation, bypass mode's losses.
"""
from __future__ import annotations

import math

import pytest
import torch

from mppo import core_algos as ca

EPS = 1e-8
BOUND = 20.0
NAN = float("nan")


# ----------------------------------------------------------------------------------------------- reference helpers
def clamp(x, lo, hi):
    return max(lo, min(hi, x))


def cells(mask):
    return [(i, t) for i in range(len(mask)) for t in range(len(mask[i])) if mask[i][t]]


def token_mean(values, mask):
    """sum(v m) / (sum(m) + 1e-8) over every token."""
    return sum(values[i][t] for i, t in cells(mask)) / (len(cells(mask)) + EPS)


def row_mean(row_values, row_mask):
    n = sum(1 for m in row_mask if m)
    return sum(v for v, m in zip(row_values, row_mask) if m) / (n + EPS)


def mean(xs):
    return sum(xs) / len(xs)


def unbiased_std(xs):
    if len(xs) < 2:
        return 0.0
    mu = mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def clamped_std(values, mask, lo, hi):
    if len(cells(mask)) < 2:
        return 0.0
    c = [[clamp(v, lo, hi) for v in row] for row in values]
    var = token_mean([[v * v for v in row] for row in c], mask) - token_mean(c, mask) ** 2
    return math.sqrt(max(var, 0.0))


def ref_is(lr, mask, level, threshold, normalize):
    """(weights, metrics) of compute_rollout_correction_weights."""
    if isinstance(threshold, str) and "_" in threshold:
        lower, upper = (float(x) for x in threshold.split("_"))
    else:
        lower, upper = None, float(threshold)
    rows, cols = len(lr), len(lr[0])
    if level == "token":
        raw = [[math.exp(clamp(lr[i][t], -BOUND, BOUND)) * mask[i][t] for t in range(cols)] for i in range(rows)]
        row_lr = None
    else:
        row_lr = [sum(lr[i][t] for t in range(cols) if mask[i][t]) for i in range(rows)]
        raw = [[math.exp(clamp(row_lr[i], -BOUND, BOUND)) * mask[i][t] for t in range(cols)] for i in range(rows)]
    if lower is None:
        w = [[min(v, upper) for v in row] for row in raw]
    else:
        w = [[v if lower <= v <= upper else 0.0 for v in row] for row in raw]
    lo = lower if lower is not None else 1.0 / upper
    valid = cells(mask)
    m = {"rollout_is_mean": token_mean(w, mask)}
    if level == "sequence":
        m["rollout_is_max"] = math.exp(min(max(row_lr), BOUND))
        m["rollout_is_min"] = math.exp(min(row_lr))
        m["rollout_is_ratio_fraction_high"] = mean([float(s > math.log(upper)) for s in row_lr])
        m["rollout_is_ratio_fraction_low"] = mean([float(s < math.log(lo)) for s in row_lr])
    else:
        m["rollout_is_ratio_fraction_high"] = token_mean([[float(v > upper) for v in r] for r in raw], mask)
        m["rollout_is_ratio_fraction_low"] = token_mean([[float(v < lo) for v in r] for r in raw], mask)
        m["rollout_is_max"] = max(w[i][t] for i, t in valid)
        m["rollout_is_min"] = min(w[i][t] for i, t in valid)
    m["rollout_is_std"] = clamped_std(w, mask, 0.0, upper)
    c = [[clamp(v, 0.0, upper) for v in row] for row in w]
    c_mean = token_mean(c, mask)
    second = token_mean([[(v / (c_mean + EPS)) ** 2 for v in row] for row in c], mask)
    m["rollout_is_eff_sample_size"] = 1.0 / second if second else NAN
    rm = [row_mean(w[i], mask[i]) for i in range(rows)]
    m["rollout_is_seq_mean"] = mean(rm)
    m["rollout_is_seq_std"] = unbiased_std(rm)
    m["rollout_is_seq_max"], m["rollout_is_seq_min"] = max(rm), min(rm)
    m["rollout_is_seq_max_deviation"] = max(abs(x - 1.0) for x in rm)
    raw_rm = [row_mean(raw[i], mask[i]) for i in range(rows)]
    m["rollout_is_seq_fraction_high"] = mean([float(x > upper) for x in raw_rm])
    m["rollout_is_seq_fraction_low"] = mean([float(x < lo) for x in raw_rm])
    if lower is not None:
        m["rollout_is_oob_ratio"] = token_mean([[float(v < lower or v > upper) for v in r] for r in raw], mask)
    if normalize:
        if level == "token":
            factor = token_mean(w, mask)
        else:
            with_tokens = [i for i in range(rows) if any(mask[i])]
            factor = sum(row_mean(w[i], mask[i]) for i in with_tokens) / max(len(with_tokens), EPS)
        if factor > 1e-8:
            w = [[v / factor for v in row] for row in w]
            m["rollout_is_batch_norm_factor"] = factor
        else:
            m["rollout_is_batch_norm_factor"] = 1.0
    return w, m


def ref_rs(lr, mask, options, spec):
    """(mask after rejection, metrics) of compute_rollout_rejection_mask."""
    rows, cols = len(lr), len(lr[0])
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    specs = [s.strip() for s in str(spec).split(",")]
    specs = specs * len(names) if len(specs) == 1 else specs
    safe = [[clamp(v, -BOUND, BOUND) for v in row] for row in lr]
    est = {"k1": [[-c for c in row] for row in safe], "k2": [[0.5 * c * c for c in row] for row in safe],
           "k3": [[math.exp(c) - 1.0 - c for c in row] for row in safe]}
    with_tokens = [i for i in range(rows) if any(mask[i])]
    keep_all = [[1.0] * cols for _ in range(rows)]
    m = {}
    for name, s in zip(names, specs):
        k = name[-2:]
        if k == "k1":
            lower, upper = ((float(x) for x in s.split("_")) if "_" in s else (1.0 / float(s), float(s)))
            lo_cmp, up_cmp = math.log(lower), math.log(upper)
        else:
            lo_cmp, up_cmp = 0.0, float(s)

        def ok(v):
            return lo_cmp <= v <= up_cmp if k == "k1" else v <= up_cmp

        stat = est[k]
        if name.startswith("token"):
            per_token = stat
            seq_vals = [row_mean(stat[i], mask[i]) for i in range(rows)]
            keep = [[ok(v) for v in row] for row in stat]
        else:
            how = name.split("_")[1]
            seq_vals = []
            for i in range(rows):
                vals = [stat[i][t] for t in range(cols) if mask[i][t]]
                seq_vals.append({"sum": sum(vals), "mean": row_mean(stat[i], mask[i]),
                                 "max": max(vals) if vals else 0.0}[how])
            per_token = [[seq_vals[i]] * cols for i in range(rows)]
            keep = [[ok(seq_vals[i])] * cols for i in range(rows)]
        p = f"rollout_rs_{name}"
        valid_seq = [seq_vals[i] for i in with_tokens]
        tok = [per_token[i][t] for i, t in cells(mask)]
        m[f"{p}_mean"] = token_mean(per_token, mask)
        source = valid_seq if not name.startswith("token") else tok
        m[f"{p}_max"], m[f"{p}_min"] = max(source), min(source)
        if name.startswith("token"):
            m[f"{p}_fraction_high"] = token_mean([[float(v > up_cmp) for v in r] for r in per_token], mask)
            m[f"{p}_fraction_low"] = (token_mean([[float(v < lo_cmp) for v in r] for r in per_token], mask)
                                      if k == "k1" else 0.0)
        else:
            m[f"{p}_fraction_high"] = mean([float(v > up_cmp) for v in valid_seq])
            m[f"{p}_fraction_low"] = mean([float(v < lo_cmp) for v in valid_seq]) if k == "k1" else 0.0
        m[f"{p}_std"] = clamped_std(per_token, mask, lo_cmp if k == "k1" else 0.0, up_cmp)
        m[f"{p}_seq_mean"], m[f"{p}_seq_std"] = mean(valid_seq), unbiased_std(valid_seq)
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = max(valid_seq), min(valid_seq)
        m[f"{p}_seq_max_deviation"] = max(abs(v) for v in valid_seq)
        m[f"{p}_seq_fraction_high"] = mean([float(v > up_cmp) for v in valid_seq])
        if k == "k1":
            m[f"{p}_seq_fraction_low"] = mean([float(v < lo_cmp) for v in valid_seq])
        m[f"{p}_masked_fraction"] = token_mean([[1.0 - keep[i][t] for t in range(cols)] for i in range(rows)], mask)
        rejected_rows = [i for i in with_tokens if any(mask[i][t] and not keep[i][t] for t in range(cols))]
        m[f"{p}_seq_masked_fraction"] = len(rejected_rows) / len(with_tokens)
        keep_all = [[keep_all[i][t] * float(keep[i][t]) for t in range(cols)] for i in range(rows)]
    m["rollout_rs_masked_fraction"] = token_mean([[1.0 - v for v in row] for row in keep_all], mask)
    m["rollout_rs_seq_masked_fraction"] = mean(
        [float(any(mask[i][t] and not keep_all[i][t] for t in range(cols))) for i in range(rows)])
    return [[mask[i][t] * keep_all[i][t] for t in range(cols)] for i in range(rows)], m


def ref_offpolicy(old, roll, mask):
    rows = len(old)
    train = [row_mean(old[i], mask[i]) for i in range(rows)]
    rollout = [row_mean(roll[i], mask[i]) for i in range(rows)]
    lr = [[o - r for o, r in zip(old[i], roll[i])] for i in range(rows)]
    diff = [rollout[i] - train[i] for i in range(rows)]
    row_lr = [clamp(sum(v for v, m_ in zip(lr[i], mask[i]) if m_), -BOUND, BOUND) for i in range(rows)]
    return {
        "training_ppl": mean([math.exp(-x) for x in train]), "training_log_ppl": mean([-x for x in train]),
        "kl": token_mean([[-v for v in row] for row in lr], mask),
        "k3_kl": token_mean([[math.exp(v) - v - 1 for v in row] for row in lr], mask),
        "rollout_ppl": mean([math.exp(-x) for x in rollout]), "rollout_log_ppl": mean([-x for x in rollout]),
        "log_ppl_diff": mean(diff), "log_ppl_abs_diff": mean([abs(d) for d in diff]),
        "log_ppl_diff_max": max(diff), "log_ppl_diff_min": min(diff), "ppl_ratio": mean([math.exp(d) for d in diff]),
        "chi2_token": token_mean([[math.exp(clamp(v, -BOUND, BOUND)) ** 2 for v in row] for row in lr], mask) - 1.0,
        "chi2_seq": mean([math.exp(2 * s) for s in row_lr]) - 1.0,
    }


# ------------------------------------------------------------------------------------------------------ test data
def make_case(name: str):
    """(old_log_prob, rollout_log_prob, mask) float64 tensors for a named edge case."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    old = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    roll = old - 0.4 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 7, dtype=torch.float64)
    if name == "extreme":  # token and sequence log-ratios past +-20
        roll[0, 1], roll[1, 2], roll[2, :] = old[0, 1] - 25.0, old[1, 2] + 31.0, old[2, :] - 4.0
    elif name == "holes":
        mask = (torch.rand(5, 7, generator=g) > 0.35).double()
        mask[3] = 0.0  # an empty row
        mask[4, 0] = 1.0
    elif name == "one_token_rows":
        mask = torch.zeros(5, 7, dtype=torch.float64)
        for i in range(5):
            mask[i, i] = 1.0
    elif name == "single_token":
        mask = torch.zeros(5, 7, dtype=torch.float64)
        mask[2, 3] = 1.0
    # garbage outside the mask must not matter
    return old.masked_fill(mask == 0, 7.0), roll.masked_fill(mask == 0, -50.0), mask


CASES = ("random", "extreme", "holes", "one_token_rows", "single_token")


def lists(*tensors):
    return [t.tolist() for t in tensors]


def assert_metrics(got: dict, want: dict, prefix: str = ""):
    want = {prefix + k: v for k, v in want.items()}
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        if math.isnan(value):
            assert math.isnan(got[key]), key
        else:
            # fractions are float32 means of 0/1 flags (veRL's `.float().mean()`); the clamped `_std` is
            # sqrt(E[v^2] - E[v]^2), whose cancellation leaves ~1e-16 / std of rounding noise
            rel = 1e-6 if "fraction" in key else 1e-9
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-9 if key.endswith("_std") else 1e-12), key


# ----------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("level,threshold", [("token", 2.0), ("token", "1.5"), ("token", "0.5_5.0"),
                                             ("token", "0.9_1.1"), ("sequence", 2.0), ("sequence", "0.5_2.0")])
@pytest.mark.parametrize("normalize", [False, True])
def test_is_weights_tis_icepop_and_batch_normalisation(case, level, threshold, normalize):
    old, roll, mask = make_case(case)
    lr = old - roll
    weights, metrics = ca.compute_rollout_correction_weights(lr, mask, rollout_is=level,
                                                             rollout_is_threshold=threshold,
                                                             rollout_is_batch_normalize=normalize)
    want_w, want_m = ref_is(*lists(lr, mask), level, threshold, normalize)
    assert not weights.requires_grad
    torch.testing.assert_close(weights, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert_metrics(metrics, want_m)


def test_icepop_keeps_its_bounds_and_zeroes_outside_without_touching_the_mask():
    lr = torch.log(torch.tensor([[0.5, 0.49, 5.0, 5.01, 1.0]], dtype=torch.float64))
    mask = torch.ones_like(lr)
    weights, _, metrics = ca.compute_rollout_correction_and_rejection_mask(
        lr, torch.zeros_like(lr), mask, rollout_is="token", rollout_is_threshold="0.5_5.0")
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.0, 5.0, 0.0, 1.0]], dtype=torch.float64))
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("option", ca.ROLLOUT_RS_OPTIONS)
def test_every_rejection_option(case, option):
    old, roll, mask = make_case(case)
    lr = old - roll
    level, estimator = option.rsplit("_", 1)
    spec = {"token": {"k1": "0.7_1.3", "k2": "0.05", "k3": "0.04"},
            "seq_sum": {"k1": "0.5_1.3", "k2": "0.6", "k3": "0.6"},
            "seq_mean": {"k1": "0.9_1.05", "k2": "0.05", "k3": "0.04"},
            "seq_max": {"k2": "0.2", "k3": "0.2"}}[level][estimator]
    new_mask, metrics = ca.compute_rollout_rejection_mask(lr, mask, rollout_rs=option, rollout_rs_threshold=spec)
    want_mask, want_m = ref_rs(*lists(lr, mask), option, spec)
    assert torch.equal(new_mask, torch.tensor(want_mask, dtype=torch.float64))
    assert_metrics(metrics, want_m)
    if case == "random":  # the thresholds bite: something is kept and something rejected
        assert 0 < new_mask.sum() < mask.sum(), option


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("options,spec", [("token_k1,seq_mean_k3", "0.6_1.6,0.05"),
                                          ("seq_max_k2,token_k3,seq_sum_k1,token_k3", "1.2"),
                                          ("token_k1", "1.5"),  # one number: ratio bounds [1/1.5, 1.5]
                                          ("seq_mean_k1,seq_sum_k2", 2)])  # a number for every option
def test_chained_rejection_keeps_what_passes_every_criterion(case, options, spec):
    old, roll, mask = make_case(case)
    lr = old - roll
    new_mask, metrics = ca.compute_rollout_rejection_mask(lr, mask, rollout_rs=options, rollout_rs_threshold=spec)
    want_mask, want_m = ref_rs(*lists(lr, mask), options, spec)
    assert torch.equal(new_mask, torch.tensor(want_mask, dtype=torch.float64))
    assert_metrics(metrics, want_m)


@pytest.mark.parametrize("case", CASES)
def test_unified_function_weights_mask_and_offpolicy_metrics(case):
    old, roll, mask = make_case(case)
    weights, new_mask, metrics = ca.compute_rollout_correction_and_rejection_mask(
        old, roll, mask, rollout_is="sequence", rollout_is_threshold=3.0, rollout_is_batch_normalize=True,
        rollout_rs="token_k2,seq_mean_k1", rollout_rs_threshold="0.08,0.8_1.25")
    lr = lists(old - roll, mask)
    want_w, is_m = ref_is(*lr, "sequence", 3.0, True)  # weights on the mask BEFORE rejection
    want_mask, rs_m = ref_rs(*lr, "token_k2,seq_mean_k1", "0.08,0.8_1.25")
    torch.testing.assert_close(weights, torch.tensor(want_w, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert torch.equal(new_mask, torch.tensor(want_mask, dtype=torch.float64))
    assert_metrics(metrics, {**is_m, **rs_m, **ref_offpolicy(*lists(old, roll, mask))}, prefix="rollout_corr/")


def test_unified_function_with_correction_off_only_measures():
    old, roll, mask = make_case("holes")
    weights, new_mask, metrics = ca.compute_rollout_correction_and_rejection_mask(old, roll, mask)
    assert weights is None and torch.equal(new_mask, mask) and new_mask is not mask
    assert_metrics(metrics, ref_offpolicy(*lists(old, roll, mask)), prefix="rollout_corr/")


@pytest.mark.parametrize("bad,error", [
    ({"rollout_is": "tokens"}, "Invalid rollout_is"),
    ({"rollout_is": "token", "rollout_is_threshold": True}, "not bool"),
    ({"rollout_is": "token", "rollout_is_threshold": "5_0.5"}, "lower bound must be <= upper"),
    ({"rollout_is": "token", "rollout_is_threshold": "-1"}, "must be positive"),
    ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0}, "Invalid rollout_rs option: token_k4"),
    ({"rollout_rs": "token_k1"}, "rollout_rs_threshold must be explicitly provided"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, "single upper bound"),
    ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1,2,3"}, "exactly 2 thresholds"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_0.5"}, "lower <= upper"),
])
def test_bad_settings_raise_naming_the_problem(bad, error):
    old, roll, mask = make_case("random")
    with pytest.raises((ValueError, TypeError), match=error):
        ca.compute_rollout_correction_and_rejection_mask(old, roll, mask, **bad)


def test_no_response_token_is_an_error():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="at least one valid token"):
        ca.compute_rollout_correction_and_rejection_mask(z, z, z)


# ------------------------------------------------------------------------------------------- bypass mode's losses
def ref_agg_token_mean(losses, mask):
    n = len(cells(mask))
    return sum(losses[i][t] for i, t in cells(mask)) / n


@pytest.mark.parametrize("loss_type", ["reinforce", "ppo_clip"])
@pytest.mark.parametrize("case", ["random", "extreme", "holes"])
def test_bypass_mode_loss_and_gradient(loss_type, case):
    """old_log_prob = the rollout's; weights/rejection from pi / pi_rollout. reinforce: -A lp w over the kept tokens;
    ppo_clip: vanilla PPO over the kept tokens, no IS weights; both divided by the tokens before rejection."""
    roll, _, mask = make_case(case)
    cur = roll + 0.3 * torch.randn(roll.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cur[0, 0] = roll[0, 0] + 0.05
    adv = torch.randn(roll.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    corr = ca.RolloutCorrectionParams(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token_k1",
                                      rollout_rs_threshold="0.75_1.25", bypass_mode=True, loss_type=loss_type)
    log_prob = cur.clone().requires_grad_(True)
    info = ca.GlobalBatchInfo(dp_size=1, batch_num_tokens=int(mask.sum()))
    loss, metrics = ca.compute_policy_loss_bypass_mode(roll, log_prob, adv, mask, "token-mean",
                                                       config=ca.PolicyLossParams(rollout_correction=corr),
                                                       batch_info=info)
    loss.backward()
    lr = (cur - roll).tolist()
    m, a, lp = mask.tolist(), adv.tolist(), cur.tolist()
    n = len(cells(m))
    kept = [[m[i][t] and math.log(0.75) <= -lr[i][t] <= math.log(1.25) for t in range(7)] for i in range(5)]
    grad = [[0.0] * 7 for _ in range(5)]
    total = 0.0
    for i, t in cells(m):
        if not kept[i][t]:
            continue
        ratio = math.exp(clamp(lr[i][t], -20, 20))
        if loss_type == "reinforce":
            w = min(ratio, 1.5)
            total += -a[i][t] * lp[i][t] * w
            grad[i][t] = -a[i][t] * w / n
        else:
            l1, l2 = -a[i][t] * ratio, -a[i][t] * clamp(ratio, 0.8, 1.2)
            c1 = max(l1, l2)
            value = min(-a[i][t] * 3.0, c1) if a[i][t] < 0 else c1
            total += value
            unclipped = l1 >= l2 and (a[i][t] >= 0 or c1 < -a[i][t] * 3.0)  # ties inside the clip: same grad
            grad[i][t] = -a[i][t] * ratio / n if unclipped else 0.0
    assert loss.item() == pytest.approx(total / n, rel=1e-12)
    torch.testing.assert_close(log_prob.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-10, atol=1e-14)
    assert 0 < metrics["rollout_corr/rollout_rs_masked_fraction"] < 1
    assert metrics["actor/ppo_kl"] == pytest.approx(
        sum(-lr[i][t] for i, t in cells(m) if kept[i][t]) / (sum(map(sum, kept)) + EPS), rel=1e-9)
