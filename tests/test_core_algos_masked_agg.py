"""mppo.core_algos masked helpers and agg_loss against plain-Python references (float64 loops) and hand cases."""
from __future__ import annotations

import math

import pytest
import torch

from mppo.core_algos import (
    AGG_LOSS_MODES,
    agg_loss,
    agg_token_weights,
    clip_by_value,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)


def _batch(seed: int, bs: int = 6, T: int = 5, empty_row: bool = True):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(bs, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (bs,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    if empty_row:
        mask[2] = 0.0
    mask[0, 1] = 0.0  # an internal gap
    return values, mask


# ---------------------------------------------------------------- masked helpers
def _ref_mean(v, m):
    num = sum(v[i][j] * m[i][j] for i in range(len(v)) for j in range(len(v[0])) if m[i][j] != 0)
    return num / (sum(sum(r) for r in m) + 1e-8)


def test_masked_sum_mean_match_loops_and_ignore_nan_outside_mask():
    values, mask = _batch(0)
    values_with_nan = values.clone()
    values_with_nan[mask == 0] = float("nan")
    v, m = values.tolist(), mask.tolist()
    expected_sum = sum(v[i][j] for i in range(6) for j in range(5) if m[i][j])
    assert masked_sum(values_with_nan, mask).item() == pytest.approx(expected_sum, rel=1e-12)
    assert masked_mean(values_with_nan, mask).item() == pytest.approx(_ref_mean(v, m), rel=1e-12)
    per_row = masked_mean(values, mask, axis=-1)
    for i in range(6):
        expected = sum(v[i][j] for j in range(5) if m[i][j]) / (sum(m[i]) + 1e-8)
        assert per_row[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert per_row[2].item() == 0.0  # empty row: 0 / (0 + 1e-8)


def test_masked_var_unbiased_and_biased():
    values, mask = _batch(1)
    selected = [x for x, k in zip(values.flatten().tolist(), mask.flatten().tolist()) if k]
    n = len(selected)
    mu = sum(selected) / n
    biased = sum((x - mu) ** 2 for x in selected) / n
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(biased, rel=1e-7)
    assert masked_var(values, mask).item() == pytest.approx(biased * n / (n - 1), rel=1e-7)


def test_masked_var_rejects_zero_or_one_selected_element():
    values = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="no element"):
        masked_var(values, torch.zeros(2, 3))
    one = torch.zeros(2, 3)
    one[1, 2] = 1
    with pytest.raises(ValueError, match="exactly one"):
        masked_var(values, one)


def test_masked_whiten_is_batch_wide_unbiased_and_not_remasked():
    values, mask = _batch(2)
    v, m = values.tolist(), mask.tolist()
    selected = [v[i][j] for i in range(6) for j in range(5) if m[i][j]]
    n = len(selected)
    mu = sum(selected) / n
    var = sum((x - mu) ** 2 for x in selected) / (n - 1)
    out = masked_whiten(values, mask)
    out_keep_mean = masked_whiten(values, mask, shift_mean=False)
    for i in range(6):
        for j in range(5):
            expected = (v[i][j] - mu) / math.sqrt(var + 1e-8)  # padding too: the result is NOT re-masked
            assert out[i, j].item() == pytest.approx(expected, rel=1e-7, abs=1e-9)
            assert out_keep_mean[i, j].item() == pytest.approx(expected + mu, rel=1e-7, abs=1e-9)
    assert (out[mask == 0] != 0).any()


def test_entropy_from_logits_and_clip_by_value():
    logits = torch.randn(2, 3, 7, dtype=torch.float64)
    ent = entropy_from_logits(logits)
    assert ent.shape == (2, 3)
    for i in range(2):
        for t in range(3):
            row = logits[i, t].tolist()
            z = sum(math.exp(x) for x in row)
            expected = -sum((math.exp(x) / z) * (x - math.log(z)) for x in row)
            assert ent[i, t].item() == pytest.approx(expected, rel=1e-10)
    x = torch.tensor([-3.0, 0.5, 4.0])
    assert clip_by_value(x, torch.tensor([-1.0, 1.0, 0.0]), torch.tensor([1.0, 2.0, 2.0])).tolist() == [-1.0, 1.0, 2.0]
    # crossing bounds: the lower bound wins (max applied last)
    assert clip_by_value(torch.tensor([0.0]), torch.tensor([1.0]), torch.tensor([-1.0])).tolist() == [1.0]


# ---------------------------------------------------------------- agg_loss
def _ref_agg(L, m, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    bs, T = len(L), len(L[0])
    if mode == "token-mean":
        total = sum(L[i][t] * m[i][t] for i in range(bs) for t in range(T) if m[i][t])
        denom = batch_num_tokens if batch_num_tokens is not None else sum(map(sum, m))
        return total / denom * dp_size
    if mode == "token-sum":
        return sum(L[i][t] * m[i][t] for i in range(bs) for t in range(T) if m[i][t]) * dp_size
    seq_losses, n_seq = [], 0
    for i in range(bs):
        n_tok = sum(m[i])
        if n_tok == 0:
            continue  # fully-masked rows are excluded (0.9.1 semantics)
        n_seq += 1
        s = sum(L[i][t] * m[i][t] for t in range(T))
        seq_losses.append(s / (n_tok + 1e-8) if mode == "seq-mean-token-mean" else s)
    G = global_batch_size if global_batch_size is not None else n_seq
    loss = sum(seq_losses) / G * dp_size
    if mode == "seq-mean-token-sum-norm":
        loss /= loss_scale_factor if loss_scale_factor is not None else T
    return loss


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
def test_agg_loss_matches_reference(mode):
    L, mask = _batch(3)
    for kwargs in ({}, {"dp_size": 4, "batch_num_tokens": 37, "global_batch_size": 9}, {"loss_scale_factor": 3.0}):
        got = agg_loss(L, mask, mode, **kwargs).item()
        assert got == pytest.approx(_ref_agg(L.tolist(), mask.tolist(), mode, **kwargs), rel=1e-12)


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
def test_agg_token_weights_give_agg_loss_as_a_weighted_sum(mode):
    # the fused PPO kernel needs each token's weight in the aggregated loss before the loss exists
    L, mask = _batch(7)
    mask[3, 0] = 0.5  # a fractional weight
    for kwargs in ({}, {"dp_size": 4, "batch_num_tokens": 37, "global_batch_size": 9}, {"loss_scale_factor": 3.0}):
        weights = agg_token_weights(mask, mode, **kwargs)
        assert weights.shape == mask.shape and bool((weights[mask == 0] == 0).all())
        expected = _ref_agg(L.tolist(), mask.tolist(), mode, **kwargs)
        assert (L * weights).sum().item() == pytest.approx(expected, rel=1e-12)
    if mode != "token-sum":  # the same errors as agg_loss
        with pytest.raises(ValueError, match="batch_num_tokens" if mode == "token-mean" else "global_batch_size"):
            agg_token_weights(mask, mode, dp_size=2)
    with pytest.raises(ValueError, match="valid modes"):
        agg_token_weights(mask, "token-average")


def test_agg_loss_hand_cases():
    L = torch.tensor([[1.0, 2.0, 5.0], [3.0, 4.0, 6.0], [7.0, 8.0, 9.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert agg_loss(L, m, "token-mean").item() == pytest.approx(6.0 / 3)
    assert agg_loss(L, m, "token-sum").item() == pytest.approx(6.0)
    # the fully-masked third row is not in the seq-mean denominator: (3 + 3) / 2, not / 3
    assert agg_loss(L, m, "seq-mean-token-sum").item() == pytest.approx(3.0)
    assert agg_loss(L, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 3.0) / 2, rel=1e-6)
    assert agg_loss(L, m, "seq-mean-token-sum-norm").item() == pytest.approx(3.0 / 3)  # / padded T = 3


def test_quirk_token_mean_has_no_epsilon():
    L = torch.ones(2, 3)
    assert math.isnan(agg_loss(L, torch.zeros(2, 3), "token-mean").item())  # 0 / 0, unlike masked_mean
    assert masked_mean(L, torch.zeros(2, 3)).item() == 0.0


def test_quirk_seq_mean_token_sum_norm_divides_by_padded_length():
    L, mask = _batch(4)
    padded_L = torch.cat([L, torch.randn(6, 3, dtype=torch.float64)], dim=1)
    padded_mask = torch.cat([mask, torch.zeros(6, 3, dtype=torch.float64)], dim=1)
    short = agg_loss(L, mask, "seq-mean-token-sum-norm")
    long = agg_loss(padded_L, padded_mask, "seq-mean-token-sum-norm")
    assert long.item() == pytest.approx(short.item() * 5 / 8, rel=1e-12)  # more padding, smaller loss
    fixed_short = agg_loss(L, mask, "seq-mean-token-sum-norm", loss_scale_factor=10)
    fixed_long = agg_loss(padded_L, padded_mask, "seq-mean-token-sum-norm", loss_scale_factor=10)
    assert fixed_short.item() == pytest.approx(fixed_long.item(), rel=1e-12)


def test_agg_loss_errors():
    L, mask = _batch(5)
    with pytest.raises(ValueError, match="batch_num_tokens"):
        agg_loss(L, mask, "token-mean", dp_size=2)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        with pytest.raises(ValueError, match="global_batch_size"):
            agg_loss(L, mask, mode, dp_size=2)
    with pytest.raises(ValueError, match="valid modes"):
        agg_loss(L, mask, "token-average")


@pytest.mark.parametrize("mode", AGG_LOSS_MODES)
def test_split_into_dp_shards_and_micro_batches_sums_to_full_batch(mode):
    """Each rank sums its micro-batch losses; DDP averages over ranks: the result must be the full-batch loss,
    for the value and for the gradient."""
    L, mask = _batch(6, bs=8, T=5)
    weights = L.clone().requires_grad_(True)
    full = agg_loss(weights * 1.5, mask, mode)
    (full_grad,) = torch.autograd.grad(full, weights)

    dp_size = 2
    info = {
        "dp_size": dp_size,
        "batch_num_tokens": int(mask.sum().item()),
        "global_batch_size": int((mask.sum(-1) > 0).sum().item()),
    }
    shards = [[0, 5, 2], [7, 1], [3], [4, 6]]  # rank 0 micro-batches, then rank 1 micro-batches
    ranks = [shards[:2], shards[2:]]
    total = 0.0
    for rank_micro_batches in ranks:
        for rows in rank_micro_batches:
            total = total + agg_loss(weights[rows] * 1.5, mask[rows], mode, **info)
    split = total / dp_size
    (split_grad,) = torch.autograd.grad(split, weights)
    assert split.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-15)
