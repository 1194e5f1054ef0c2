"""Advantage estimators of mppo.core_algos against plain-Python references (row loops in float64), hand cases,
properties, the veRL quirks they keep, the registry and the `compute_advantage` dispatcher."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from mppo.core_algos import (
    ADV_ESTIMATOR_REGISTRY,
    ESTIMATORS_NEEDING_CRITIC,
    ESTIMATORS_NEEDING_GROUPS,
    estimator_spec,
    compute_advantage,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)

BS, T = 7, 6
UIDS = np.array(["a", "b", "a", "c", "b", "a", "b"], dtype=object)  # non-contiguous groups; "c" is a singleton


def _batch(seed: int, bs: int = BS, t_len: int = T):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(bs, t_len, generator=g, dtype=torch.float64)
    values = torch.randn(bs, t_len, generator=g, dtype=torch.float64)
    lengths = torch.randint(2, t_len + 1, (bs,), generator=g)
    mask = (torch.arange(t_len)[None, :] < lengths[:, None]).double()
    mask[1, 1] = 0.0  # an internal masked span (e.g. an observation token)
    return rewards, values, mask


# veRL's singleton-group std is torch.tensor(1.0), a float32, so `std + 1e-6` is rounded to float32 even when the
# rewards are float64.
SINGLETON_STD_PLUS_EPS = float(np.float32(1.0) + np.float32(1e-6))


def _whiten_ref(x, m):
    """Batch-wide whitening over masked elements, applied to every position: masked means divide by (N + 1e-8),
    the variance gets Bessel's N/(N-1), and 1e-8 is added before the square root."""
    sel = [x[i][t] for i in range(len(x)) for t in range(len(x[0])) if m[i][t]]
    n = len(sel)
    mu = sum(sel) / (n + 1e-8)
    var = sum((v - mu) ** 2 for v in sel) / (n + 1e-8) * (n / (n - 1))
    return [[(v - mu) / math.sqrt(var + 1e-8) for v in row] for row in x]


def _groups(uids):
    out = {}
    for i, u in enumerate(uids):
        out.setdefault(u, []).append(i)
    return out


def _close(got: torch.Tensor, expected, rel=1e-9, abs_=1e-10):
    torch.testing.assert_close(got, torch.tensor(expected, dtype=got.dtype), rtol=rel, atol=abs_)


# ---------------------------------------------------------------- GAE
def _gae_ref(r, v, m, gamma, lam):
    adv_raw, ret = [], []
    for i in range(len(r)):
        next_value, last_gae = 0.0, 0.0
        row = [0.0] * len(r[i])
        for t in reversed(range(len(r[i]))):
            if m[i][t]:  # masked steps are skipped: next_value and last_gae carry through them
                delta = r[i][t] + gamma * next_value - v[i][t]
                last_gae = delta + gamma * lam * last_gae
                next_value = v[i][t]
            row[t] = last_gae
        adv_raw.append(row)
        ret.append([a + b for a, b in zip(row, v[i])])
    return _whiten_ref(adv_raw, m), ret


def test_gae_matches_reference_with_internal_gap_and_padding():
    rewards, values, mask = _batch(0)
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.97, lam=0.9)
    exp_adv, exp_ret = _gae_ref(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, 0.9)
    _close(adv, exp_adv)
    _close(ret, exp_ret)


def test_gae_hand_case():
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    v = torch.tensor([[0.5, 0.2], [0.1, 0.7]], dtype=torch.float64)
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    adv, ret = compute_gae_advantage_return(r, v, m, gamma=1.0, lam=1.0)
    # row 0: t=1 delta = 1 - 0.2 = 0.8; t=0 delta = 0 + 0.2 - 0.5 = -0.3, A = -0.3 + 0.8 = 0.5
    _close(ret, [[1.0, 1.0], [0.1, 0.7]])  # returns = A_raw + V, including V on the padded row
    std = math.sqrt(2 * 0.15**2 / 1 + 1e-8)
    _close(adv, [[-0.15 / std, 0.15 / std], [-0.65 / std, -0.65 / std]], rel=1e-7)  # padded row: -mean/std


def test_quirk_gae_whitening_not_remasked_and_bool_mask_accepted():
    rewards, values, mask = _batch(1)
    adv_f, ret_f = compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95)
    adv_b, ret_b = compute_gae_advantage_return(rewards, values, mask.bool(), 0.99, 0.95)
    torch.testing.assert_close(adv_b, adv_f, rtol=0, atol=0)
    torch.testing.assert_close(ret_b, ret_f, rtol=0, atol=0)
    assert (adv_f[mask == 0] != 0).all()


# ---------------------------------------------------------------- GRPO family
def _grpo_ref(scores, uids, eps, norm):
    adv = [0.0] * len(scores)
    for rows in _groups(uids).values():
        s = [scores[i] for i in rows]
        for i in rows:
            if len(s) == 1:
                adv[i] = scores[i] / SINGLETON_STD_PLUS_EPS if norm else scores[i]
                continue
            mean, std = statistics.fmean(s), statistics.stdev(s)  # stdev: ddof=1
            adv[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return adv


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference_with_full_row_score(norm):
    rewards, _, mask = _batch(2)
    adv, ret = compute_grpo_outcome_advantage(rewards, mask, UIDS, norm_adv_by_std_in_grpo=norm)
    scores = [sum(row) for row in rewards.tolist()]  # whole row: the mask is NOT applied before the sum
    expected = _grpo_ref(scores, list(UIDS), 1e-6, norm)
    _close(adv, [[expected[i] * m for m in mask[i].tolist()] for i in range(BS)])
    assert ret is adv or torch.equal(ret, adv)
    assert (adv[mask == 0] == 0).all()


def test_quirk_grpo_score_ignores_mask_eps_on_std_singleton_and_equal_groups():
    r = torch.tensor([[1.0, 5.0], [2.0, 0.0], [3.0, 0.0], [4.0, 4.0], [1.0, 1.0], [2.0, 0.0]])
    m = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    uids = ["g", "g", "g", "solo", "eq", "eq"]
    adv, _ = compute_grpo_outcome_advantage(r, m, uids)
    # group g scores 6, 2, 3 (row 0 keeps its masked 5): mean 11/3, unbiased std
    std = statistics.stdev([6.0, 2.0, 3.0])
    assert adv[0, 0].item() == pytest.approx((6 - 11 / 3) / (std + 1e-6), rel=1e-6)
    assert adv[0, 1].item() == 0.0
    assert adv[3, 0].item() == pytest.approx(8.0 / (1 + 1e-6), rel=1e-7)  # singleton: mean 0, std 1
    adv64, _ = compute_grpo_outcome_advantage(r.double(), m.double(), uids)
    assert adv64[3, 0].item() == 8.0 / SINGLETON_STD_PLUS_EPS  # the float32 std of veRL's singleton, exactly
    assert adv[4].tolist() == [0.0, 0.0] and adv[5].tolist() == [0.0, 0.0]  # all-equal group: exactly 0


def test_grpo_advantages_sum_to_zero_within_each_group_without_std_norm():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 2, (12, 4), generator=g).double()
    mask = torch.ones(12, 4, dtype=torch.float64)
    uids = np.array([f"p{i % 4}" for i in range(12)], dtype=object)
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=False)
    for rows in _groups(list(uids)).values():
        assert adv[rows, 0].sum().item() == pytest.approx(0.0, abs=1e-12)


def test_rloo_and_quirk_vectorized_disagree_on_singletons():
    rewards, _, mask = _batch(4)
    scores = [sum(row) for row in rewards.tolist()]
    expected, expected_vec = [], []
    for i, u in enumerate(UIDS):
        others = [scores[j] for j in range(BS) if UIDS[j] == u and j != i]
        expected.append(scores[i] - sum(others) / len(others) if others else scores[i])  # singleton: raw score
        expected_vec.append(scores[i] - sum(others) / len(others) if others else 0.0)  # vectorized: 0
    adv, _ = compute_rloo_outcome_advantage(rewards, mask, UIDS)
    adv_vec, _ = compute_rloo_vectorized_outcome_advantage(rewards, mask, UIDS)
    _close(adv, [[expected[i] * m for m in mask[i].tolist()] for i in range(BS)])
    _close(adv_vec, [[expected_vec[i] * m for m in mask[i].tolist()] for i in range(BS)])
    singleton = list(UIDS).index("c")
    assert adv[singleton, 0].item() != 0.0 and adv_vec[singleton, 0].item() == 0.0


def test_reinforce_plus_plus_baseline_whitens_batch_wide():
    rewards, _, mask = _batch(5)
    scores = [sum(row) for row in rewards.tolist()]
    centered = []
    for i, u in enumerate(UIDS):
        group = [scores[j] for j in range(BS) if UIDS[j] == u]
        mean = sum(group) / len(group) if len(group) > 1 else 0.0
        centered.append([(scores[i] - mean) * m for m in mask[i].tolist()])
    whitened = _whiten_ref(centered, mask.tolist())
    expected = [[w * m for w, m in zip(wr, mr)] for wr, mr in zip(whitened, mask.tolist())]
    adv, ret = compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, UIDS)
    _close(adv, expected)
    torch.testing.assert_close(ret, adv)


def test_opo_length_weighted_baseline():
    rewards, _, mask = _batch(6)
    scores = [sum(row) for row in rewards.tolist()]
    lengths = [sum(row) for row in mask.tolist()]
    expected = []
    for i, u in enumerate(UIDS):
        rows = [j for j in range(BS) if UIDS[j] == u]
        base = 0.0 if len(rows) == 1 else sum(lengths[j] * scores[j] for j in rows) / sum(lengths[j] for j in rows)
        expected.append([(scores[i] - base) * m for m in mask[i].tolist()])
    adv, _ = compute_opo_outcome_advantage(rewards, mask, UIDS)
    _close(adv, expected)


def test_gpg_and_quirk_alpha_argument_ignored():
    rewards = torch.zeros(6, 3, dtype=torch.float64)
    rewards[0, 2], rewards[2, 0], rewards[3, 1], rewards[5, 2] = 1.0, 2.0, 1.5, -1.0  # 4 non-zero scores of 6
    mask = torch.ones(6, 3, dtype=torch.float64)
    mask[4, 2] = 0.0
    uids = ["x", "x", "x", "y", "y", "z"]
    scores = [1.0, 0.0, 2.0, 1.5, 0.0, -1.0]
    alpha = 6 / 4
    means = {"x": 1.0, "y": 0.75, "z": 0.0}  # singleton z: mean 0
    expected = [[alpha * (scores[i] - means[uids[i]]) * m for m in mask[i].tolist()] for i in range(6)]
    adv, _ = compute_gpg_outcome_advantage(rewards, mask, uids)
    adv_alpha, _ = compute_gpg_outcome_advantage(rewards, mask, uids, alpha=123.0)
    _close(adv, expected, rel=1e-6)
    torch.testing.assert_close(adv_alpha, adv, rtol=0, atol=0)


def test_grpo_passk_and_quirk_config_overrides_keyword():
    r = torch.tensor([[1.0], [3.0], [2.0], [0.5], [0.5], [0.0]], dtype=torch.float64)
    m = torch.ones(6, 1, dtype=torch.float64)
    uids = ["a", "a", "a", "b", "b", "b"]
    std_a, std_b = statistics.stdev([1.0, 3.0, 2.0]), statistics.stdev([0.5, 0.5, 0.0])
    adv, _ = compute_grpo_passk_outcome_advantage(r, m, uids)
    _close(adv, [[0.0], [1.0 / (std_a + 1e-6)], [0.0], [0.0], [0.0], [0.0]])  # tie in b: r_max - r_2nd = 0
    raw, _ = compute_grpo_passk_outcome_advantage(r, m, uids, norm_adv_by_std_in_grpo=False)
    _close(raw, [[0.0], [1.0], [0.0], [0.0], [0.0], [0.0]])
    # veRL reads the flag from config and ignores the keyword
    via_config, _ = compute_grpo_passk_outcome_advantage(
        r, m, uids, norm_adv_by_std_in_grpo=True, config={"norm_adv_by_std_in_grpo": False}
    )
    torch.testing.assert_close(via_config, raw)
    with pytest.raises(ValueError, match="at least 2"):
        compute_grpo_passk_outcome_advantage(r[:4], m[:4], ["a", "a", "a", "solo"])
    assert std_b > 0


# ---------------------------------------------------------------- REINFORCE++ and ReMax
def test_reinforce_plus_plus_matches_reference():
    rewards, _, mask = _batch(7)
    gamma = 0.9
    returns = []
    for r_row, m_row in zip(rewards.tolist(), mask.tolist()):
        run, row = 0.0, [0.0] * T
        for t in reversed(range(T)):
            if m_row[t]:  # masked steps: return 0 there, running return carried without discount
                run = r_row[t] + gamma * run
                row[t] = run
        returns.append(row)
    whitened = _whiten_ref(returns, mask.tolist())
    adv, ret = compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=gamma)
    _close(ret, returns)
    _close(adv, [[w * m for w, m in zip(wr, mr)] for wr, mr in zip(whitened, mask.tolist())])


def test_remax():
    rewards, _, mask = _batch(8)
    baselines = torch.randn(BS, dtype=torch.float64)
    adv, ret = compute_remax_outcome_advantage(rewards, baselines, mask)
    r, m = rewards.tolist(), mask.tolist()
    exp_ret = [[sum(r[i][k] * m[i][k] for k in range(t, T)) for t in range(T)] for i in range(BS)]
    _close(ret, exp_ret)
    _close(adv, [[exp_ret[i][t] - baselines[i].item() * mask[i, t].item() for t in range(T)] for i in range(BS)])


# ---------------------------------------------------------------- registry and dispatcher
def test_registry_names_and_groups():
    expected = {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
                "grpo_passk", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline",
                "tir_optimal_token_baseline"}
    assert expected <= set(ADV_ESTIMATOR_REGISTRY)
    assert ESTIMATORS_NEEDING_CRITIC == {"gae"}
    assert ESTIMATORS_NEEDING_GROUPS <= set(ADV_ESTIMATOR_REGISTRY)
    assert {"grpo", "rloo", "grpo_passk", "opo", "gpg"} <= ESTIMATORS_NEEDING_GROUPS
    assert not ESTIMATORS_NEEDING_GROUPS & {"gae", "remax", "reinforce_plus_plus"}
    assert get_adv_estimator_fn("grpo") is compute_grpo_outcome_advantage
    with pytest.raises(ValueError, match="valid names.*gae"):
        get_adv_estimator_fn("ppo_magic")


def test_register_adv_est_plugs_into_dispatcher_and_rejects_duplicates():
    @register_adv_est("test_only_constant", params=("gamma",))
    def constant(token_level_rewards, response_mask, gamma):
        return response_mask * gamma, response_mask

    try:
        rewards, _, mask = _batch(9)
        adv, _ = compute_advantage("test_only_constant", token_level_rewards=rewards, response_mask=mask, gamma=0.5)
        torch.testing.assert_close(adv, mask * 0.5)
        with pytest.raises(ValueError, match="already registered"):
            register_adv_est("test_only_constant")(lambda token_level_rewards, response_mask: None)
    finally:
        del ADV_ESTIMATOR_REGISTRY["test_only_constant"]


def test_declarations_are_checked_and_passed_exactly():
    """An estimator gets exactly what it declared; a declared name it does not take, or an unknown input, is refused
    at registration."""
    spec = estimator_spec("optimal_token_baseline")
    assert spec.needs == ("index", "old_log_probs", "sum_pi_squared") and spec.optional == ("rollout_is_weights",)
    assert estimator_spec("remax").needs == ("reward_baselines",) and estimator_spec("gae").params == ("gamma", "lam")
    seen = {}

    @register_adv_est("test_only_spy", needs=("index",))
    def spy(token_level_rewards, response_mask, index, gamma=None, values=None):
        seen.update(index=index, gamma=gamma, values=values)
        return response_mask, response_mask

    try:
        rewards, values, mask = _batch(14)
        compute_advantage("test_only_spy", token_level_rewards=rewards, response_mask=mask, index=UIDS, gamma=0.3,
                          values=values)
        assert seen["index"] is UIDS and seen["gamma"] is None and seen["values"] is None
        with pytest.raises(ValueError, match="does not take"):
            register_adv_est("test_only_bad", needs=("values",))(lambda token_level_rewards, response_mask: None)
        with pytest.raises(ValueError, match="unknown inputs"):
            register_adv_est("test_only_bad", needs=("critic",))(lambda token_level_rewards, response_mask: None)
        assert "test_only_bad" not in ADV_ESTIMATOR_REGISTRY
    finally:
        del ADV_ESTIMATOR_REGISTRY["test_only_spy"]


def test_compute_advantage_dispatches_like_direct_calls():
    rewards, values, mask = _batch(10)
    baselines = torch.randn(BS, dtype=torch.float64)
    common = dict(token_level_rewards=rewards, response_mask=mask)
    cases = {
        "gae": (dict(values=values, gamma=0.9, lam=0.8),
                lambda: compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8)),
        "grpo": (dict(index=UIDS, norm_adv_by_std_in_grpo=False),
                 lambda: compute_grpo_outcome_advantage(rewards, mask, UIDS, norm_adv_by_std_in_grpo=False)),
        "rloo": (dict(index=UIDS), lambda: compute_rloo_outcome_advantage(rewards, mask, UIDS)),
        "reinforce_plus_plus": (dict(gamma=0.7),
                                lambda: compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.7)),
        "remax": (dict(reward_baselines=baselines), lambda: compute_remax_outcome_advantage(rewards, baselines, mask)),
        "gpg": (dict(index=UIDS), lambda: compute_gpg_outcome_advantage(rewards, mask, UIDS)),
        "opo": (dict(index=UIDS), lambda: compute_opo_outcome_advantage(rewards, mask, UIDS)),
    }
    for name, (kwargs, direct) in cases.items():
        got, expected = compute_advantage(name, **common, **kwargs), direct()
        torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0, msg=name)
    passk_uids = np.array(["p", "q"] * 3 + ["q"], dtype=object)
    got, _ = compute_advantage("grpo_passk", **common, index=passk_uids, norm_adv_by_std_in_grpo=False)
    expected, _ = compute_grpo_passk_outcome_advantage(rewards, mask, passk_uids,
                                                       config={"norm_adv_by_std_in_grpo": False})
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_compute_advantage_missing_inputs_are_clear_errors():
    rewards, _, mask = _batch(11)
    with pytest.raises(ValueError, match="'gae' needs `values`.*critic"):
        compute_advantage("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="'grpo' needs `index`"):
        compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="'remax' needs `reward_baselines`"):
        compute_advantage("remax", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="Unknown advantage estimator"):
        compute_advantage("nope", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="group ids"):
        compute_grpo_outcome_advantage(rewards, mask, UIDS[:3])


def test_index_forms_give_the_same_groups():
    rewards, _, mask = _batch(12)
    ids = [0, 1, 0, 2, 1, 0, 1]
    as_list, _ = compute_grpo_outcome_advantage(rewards, mask, ids)
    as_numpy, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(ids))
    as_tensor, _ = compute_grpo_outcome_advantage(rewards, mask, torch.tensor(ids))
    as_uids, _ = compute_grpo_outcome_advantage(rewards, mask, UIDS)
    for other in (as_numpy, as_tensor, as_uids):
        torch.testing.assert_close(other, as_list, rtol=0, atol=0)


def test_dtype_is_kept_and_float32_matches_float64_reference():
    rewards, values, mask = _batch(13)
    r32, v32, m32 = rewards.float(), values.float(), mask.float()
    for name, kwargs in [("gae", dict(values=v32, gamma=0.9, lam=0.9)), ("grpo", dict(index=UIDS)),
                         ("rloo", dict(index=UIDS)), ("reinforce_plus_plus", {}), ("opo", dict(index=UIDS))]:
        adv32, ret32 = compute_advantage(name, token_level_rewards=r32, response_mask=m32, **kwargs)
        assert adv32.dtype == torch.float32 and ret32.dtype == torch.float32
        kwargs64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        adv64, _ = compute_advantage(name, token_level_rewards=rewards, response_mask=mask, **kwargs64)
        torch.testing.assert_close(adv32.double(), adv64, rtol=1e-4, atol=1e-5)
