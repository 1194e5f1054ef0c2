"""KL estimators, KL controllers and apply_kl_penalty of mppo.core_algos against formulas written out per element."""
from __future__ import annotations

import math

import pytest
import torch

from mppo.core_algos import (
    KL_PENALTY_TYPES,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_rewards,
    get_kl_controller,
    kl_penalty,
)


def _k_ref(lp: float, ref: float, name: str) -> float:
    d = lp - ref
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d * d
    x = min(max(ref - lp, -20.0), 20.0)  # k3 with veRL's clamps
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def _k_grad_ref(lp: float, ref: float, name: str) -> float:
    if name.endswith("+"):
        return lp - ref  # straight-through: gradient of k2
    d = lp - ref
    if name in ("kl", "k1"):
        return 1.0
    if name == "abs":
        return math.copysign(1.0, d)
    if name in ("mse", "k2"):
        return d
    x = ref - lp
    if abs(x) >= 20 or math.exp(x) - x - 1 >= 10:
        return 0.0  # a clamp is active
    return 1.0 - math.exp(x)


def test_kl_types_listed():
    assert set(KL_PENALTY_TYPES) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+",
                                     "k2+", "low_var_kl+", "k3+"}


@pytest.mark.parametrize("name", KL_PENALTY_TYPES)
def test_kl_penalty_value_and_gradient(name):
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 5, generator=g, dtype=torch.float64) - 1.0)
    ref = lp + torch.randn(3, 5, generator=g, dtype=torch.float64)
    ref[0, 0] = lp[0, 0] + 25.0  # exercises the +-20 clamp of k3
    ref[0, 1] = lp[0, 1] + 3.0  # exp(3) - 4 = 16 > 10: exercises the +-10 clamp
    lp = lp.requires_grad_(True)
    out = kl_penalty(lp, ref, name)
    (grad,) = torch.autograd.grad(out.sum(), lp)
    base = name.rstrip("+")
    for i in range(3):
        for t in range(5):
            a, b = lp[i, t].item(), ref[i, t].item()
            assert out[i, t].item() == pytest.approx(_k_ref(a, b, base), rel=1e-12, abs=1e-14)  # "+": same value
            assert grad[i, t].item() == pytest.approx(_k_grad_ref(a, b, name), rel=1e-9, abs=1e-12)


def test_kl_penalty_is_not_masked_and_k3_clamps_hand_case():
    lp = torch.tensor([0.0, 0.0, 0.0])
    ref = torch.tensor([25.0, -1.0, 0.0])
    out = kl_penalty(lp, ref, "k3")
    assert out[0].item() == 10.0  # exp(20) - 21 clamped to 10
    assert out[1].item() == pytest.approx(math.exp(-1) + 1 - 1, rel=1e-6)
    assert out[2].item() == 0.0


def test_kl_penalty_errors():
    x = torch.zeros(2)
    with pytest.raises(NotImplementedError, match="full"):
        kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match="valid names"):
        kl_penalty(x, x, "k4")
    with pytest.raises(NotImplementedError):  # veRL raises NotImplementedError for unknown names
        kl_penalty(x, x, "k4+")


def test_compute_rewards():
    scores, old, ref = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(compute_rewards(scores, old, ref, 0.1), scores - 0.1 * (old - ref))


def test_adaptive_controller_sequence_and_clip():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    expected = 0.2
    for kl, n in [(0.15, 64), (0.5, 64), (0.0, 32), (0.1, 10)]:
        ctrl.update(kl, n)
        err = min(max(kl / 0.1 - 1, -0.2), 0.2)
        expected *= 1 + err * n / 1000
        assert ctrl.value == pytest.approx(expected, rel=1e-14)
    fixed = FixedKLController(0.3)
    fixed.update(10.0, 100)
    assert fixed.value == 0.3


def test_controller_state_round_trip_restores_coefficient():
    ctrl = AdaptiveKLController(0.05, 0.02, 500)
    ctrl.update(0.3, 128)
    resumed = get_kl_controller("adaptive", kl_coef=0.05, target_kl=0.02, horizon=500)
    resumed.load_state_dict(ctrl.state_dict())
    assert resumed.value == ctrl.value != 0.05
    ctrl.update(0.01, 64)
    resumed.update(0.01, 64)
    assert resumed.value == ctrl.value


def test_get_kl_controller():
    assert isinstance(get_kl_controller("fixed", 0.001), FixedKLController)
    assert isinstance(get_kl_controller("adaptive", 0.001), AdaptiveKLController)
    with pytest.raises(ValueError, match="horizon"):
        get_kl_controller("adaptive", 0.001, horizon=0)
    with pytest.raises(ValueError, match="valid types"):
        get_kl_controller("pid", 0.001)


@pytest.mark.parametrize("name", ["kl", "low_var_kl", "k3+"])
def test_apply_kl_penalty_against_loops(name):
    g = torch.Generator().manual_seed(1)
    bs, T = 5, 4
    scores = torch.randn(bs, T, generator=g, dtype=torch.float64)
    old = torch.randn(bs, T, generator=g, dtype=torch.float64) - 2
    ref = old + 0.3 * torch.randn(bs, T, generator=g, dtype=torch.float64)
    mask = torch.ones(bs, T, dtype=torch.float64)
    mask[1, 2:] = 0
    mask[3] = 0  # a row without tokens: counts as 0 in current_kl but still in the batch mean
    ctrl = AdaptiveKLController(0.1, 0.05, 200)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kl_penalty=name)

    base = name.rstrip("+")
    row_means = []
    for i in range(bs):
        klds = [_k_ref(old[i, t].item(), ref[i, t].item(), base) * mask[i, t].item() for t in range(T)]
        for t in range(T):
            assert rewards[i, t].item() == pytest.approx(scores[i, t].item() - 0.1 * klds[t], rel=1e-12, abs=1e-14)
        row_means.append(sum(klds) / (sum(mask[i].tolist()) + 1e-8))
    current_kl = sum(row_means) / bs
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1  # the value BEFORE this step's update
    assert all(type(v) is float for v in metrics.values())
    err = min(max(current_kl / 0.05 - 1, -0.2), 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + err * bs / 200), rel=1e-12)  # n_steps = number of rows


def test_quirk_apply_kl_penalty_empty_rows_dilute_current_kl():
    old = torch.zeros(2, 3)
    ref = torch.full((2, 3), -1.0)  # k1 = 1 everywhere
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    _, metrics = apply_kl_penalty(torch.zeros(2, 3), old, ref, mask, FixedKLController(0.5))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(0.5, rel=1e-6)  # (1 + 0) / 2, not 1
