"""Optimal-token-baseline estimators and vectorized GRPO of mppo.core_algos against Python loops in float64."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from mppo.core_algos import (
    compute_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
)

UIDS = ["a", "b", "a", "a", "b", "c", "b"]
BS, T = len(UIDS), 6


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 3, 4, 2, 3, 5, 1]  # group a: unique longest (6 > 4); group b: tie at 3
    mask = torch.zeros(BS, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[0, 2] = 0  # an internal (tool-output) span
    mask[3, 1] = 0
    rewards = torch.randn(BS, T, generator=g, dtype=torch.float64) * mask
    old = -torch.rand(BS, T, generator=g, dtype=torch.float64) * 2
    sum_pi_sq = torch.rand(BS, T, generator=g, dtype=torch.float64) * 0.5
    is_w = torch.rand(BS, T, generator=g, dtype=torch.float64) + 0.5
    return rewards, mask, old, sum_pi_sq, is_w


def _per_row(rewards, mask, old, sum_pi_sq, is_w):
    """Reward-to-go G and cumulative path weights W per row (lists)."""
    G, W = [], []
    for i in range(BS):
        g_row = [sum(rewards[i][s] * mask[i][s] for s in range(t, T)) for t in range(T)]
        acc, w_row = 0.0, []
        for t in range(T):
            w = 1 - 2 * math.exp(old[i][t]) + sum_pi_sq[i][t]
            if is_w is not None:
                w *= is_w[i][t] ** 2
            acc += w * mask[i][t]
            w_row.append(acc)
        G.append(g_row), W.append(w_row)
    return G, W


def _groups(ids, rows):
    out = {}
    for i in rows:
        out.setdefault(ids[i], []).append(i)
    return out


def _zero_tail(baseline, rows, lengths):
    ordered = sorted(lengths[i] for i in rows)
    longest = [i for i in rows if lengths[i] == ordered[-1]]
    if len(longest) == 1 and ordered[-1] > ordered[-2]:
        for t in range(ordered[-2], len(baseline[longest[0]])):
            baseline[longest[0]][t] = 0.0


def _otb_ref(rewards, mask, old, sum_pi_sq, is_w, zero_tail):
    G, W = _per_row(rewards, mask, old, sum_pi_sq, is_w)
    base = [[0.0] * T for _ in range(BS)]
    lengths = [int(sum(r)) for r in mask]
    for rows in _groups(UIDS, range(BS)).values():
        if len(rows) < 2:
            continue
        for t in range(T):
            num = sum(G[j][t] * W[j][t] * mask[j][t] for j in rows)
            den = sum(W[j][t] * mask[j][t] for j in rows) + 1e-8
            for j in rows:
                base[j][t] = num / den
        if zero_tail:
            _zero_tail(base, rows, lengths)
    return [[(G[i][t] - base[i][t]) * mask[i][t] for t in range(T)] for i in range(BS)], G


def _tir_ref(rewards, mask, old, sum_pi_sq, is_w, zero_tail):
    G, W = _per_row(rewards, mask, old, sum_pi_sq, is_w)
    valid = [[t for t in range(T) if mask[i][t]] for i in range(BS)]  # k-th generated token -> position
    lengths = [len(v) for v in valid]
    base = [[0.0] * T for _ in range(BS)]  # indexed by k (compacted step)
    for rows in _groups(UIDS, [i for i in range(BS) if lengths[i]]).values():
        if len(rows) < 2:
            continue
        for k in range(max(lengths)):
            members = [j for j in rows if k < lengths[j]]  # shorter rows contribute zeros
            num = sum(G[j][valid[j][k]] * W[j][valid[j][k]] for j in members)
            den = sum(W[j][valid[j][k]] for j in members) + 1e-8
            for j in rows:
                base[j][k] = num / den
        if zero_tail:
            _zero_tail(base, rows, lengths)
    adv = [[0.0] * T for _ in range(BS)]
    for i in range(BS):
        for k, t in enumerate(valid[i]):
            adv[i][t] = G[i][t] - base[i][k]
    return adv, G


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [True, False])
def test_optimal_token_baseline_matches_reference(zero_tail, with_is):
    rewards, mask, old, spi, is_w = _batch(0)
    w = is_w if with_is else None
    adv, ret = compute_optimal_token_baseline_advantage(rewards, mask, UIDS, old, spi, w, handle_zero_tail=zero_tail)
    exp_adv, exp_ret = _otb_ref(*(x.tolist() for x in (rewards, mask, old, spi)), is_w.tolist() if with_is else None,
                                zero_tail)
    torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("zero_tail", [True, False])
def test_tir_optimal_token_baseline_aligns_generated_tokens(zero_tail):
    rewards, mask, old, spi, is_w = _batch(1)
    mask[6] = 0  # an empty response is left out of its group
    adv, ret = compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, UIDS, old, spi, is_w,
                                                                   handle_zero_tail=zero_tail)
    exp_adv, exp_ret = _tir_ref(*(x.tolist() for x in (rewards, mask, old, spi, is_w)), zero_tail)
    torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64), rtol=1e-9, atol=1e-10)


def test_otb_identical_responses_get_zero_advantage_and_singletons_keep_returns():
    rewards, mask, old, spi, _ = _batch(2)
    ids = ["x", "x", "solo", "y", "y", "y", "z"]
    for rows in ([0, 1], [3, 4, 5]):
        for tensor in (rewards, mask, old, spi):
            tensor[rows] = tensor[rows[0]].clone()
    adv, ret = compute_optimal_token_baseline_advantage(rewards, mask, ids, old, spi)
    assert adv[[0, 1, 3, 4, 5]].abs().max().item() < 1e-6
    torch.testing.assert_close(adv[[2, 6]], ret[[2, 6]] * mask[[2, 6]])


def test_compute_advantage_otb_needs_sum_pi_squared():
    rewards, mask, old, spi, _ = _batch(3)
    with pytest.raises(ValueError, match="needs `sum_pi_squared`"):
        compute_advantage("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask, index=UIDS,
                          old_log_probs=old)
    got = compute_advantage("tir_optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                            index=UIDS, old_log_probs=old, sum_pi_squared=spi)
    expected = compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, UIDS, old, spi)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_vectorized_matches_statistics_in_float32(norm):
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(BS, T, generator=g, dtype=torch.float64)
    mask = torch.ones(BS, T, dtype=torch.float64)
    mask[2, 3:] = 0
    adv, _ = compute_grpo_vectorized_outcome_advantage(rewards, mask, np.array(UIDS, dtype=object),
                                                       norm_adv_by_std_in_grpo=norm)
    scores = [sum(r) for r in rewards.tolist()]
    for i, u in enumerate(UIDS):
        group = [scores[j] for j in range(BS) if UIDS[j] == u]
        mean, std = (0.0, 1.0) if len(group) == 1 else (statistics.fmean(group), statistics.stdev(group))
        expected = (scores[i] - mean) / (std + 1e-6) if norm else scores[i] - mean
        for t in range(T):
            # group statistics are float32 (veRL's group_mean_std), so agreement is to float32 precision
            assert adv[i, t].item() == pytest.approx(expected * mask[i, t].item(), rel=1e-5, abs=1e-5)
    loop, _ = compute_grpo_outcome_advantage(rewards.float(), mask.float(), UIDS, norm_adv_by_std_in_grpo=norm)
    torch.testing.assert_close(adv.float(), loop, rtol=1e-5, atol=1e-5)
