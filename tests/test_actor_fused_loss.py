"""The actor update through the fused gradient-in-forward loss kernel equals the reference path (full-logit
log-probs + core_algos, and the fused log-prob op + core_algos) at TP1 (DP2) and TP2, fp32: two AdamW steps of
lr 1e-2 move the weights by far more than the tolerance (weights to 1e-5 absolute, metrics to 1e-5 relative
above 1 and absolute below: ppo_kl is a small mean of large cancelling terms).
Also: which path a config takes, and why (mppo.workers.loss_selection). One torchrun launch runs every case
(tests/dist/actor_fused_loss.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_util import run_cases

SCRIPT = Path(__file__).parent / "dist" / "actor_fused_loss.py"
CASES = ("token-mean/k3/isw", "seq-mean-token-sum-norm/k2+/clip-higher", "seq-mean-token-mean/on-policy")
WEIGHT_ATOL = 1e-5
METRIC_RTOL = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_cases(SCRIPT, 2, tmp_path_factory.mktemp("actor_fused_loss"), timeout=600)


@pytest.mark.parametrize("tp", (1, 2))
@pytest.mark.parametrize("case", CASES)
def test_fused_loss_update_equals_reference_paths(ranks, tp, case):
    key = f"tp{tp}/{case}"
    for r in ranks:
        assert r[f"{key}/fused/fused_loss"] is True, "the covered config did not take the fused path"
        assert r[f"{key}/naive/fused_loss"] is False and r[f"{key}/recompute/fused_loss"] is False
        assert r[f"{key}/moved"] > 100 * WEIGHT_ATOL  # the update is large enough to matter
        for other in ("naive", "recompute"):
            assert r[f"{key}/weights_vs_{other}"] <= WEIGHT_ATOL, (other, r[f"{key}/weights_vs_{other}"])
            worst = max(r[f"{key}/metrics_vs_{other}"].items(), key=lambda kv: kv[1])
            assert worst[1] <= METRIC_RTOL, (other, worst)
    metrics = ranks[0][f"{key}/metrics"]
    assert all(r[f"{key}/metrics"] == metrics for r in ranks), "ranks report different metrics"
    assert metrics["skipped"] is False
    if case.endswith("on-policy"):
        for r in ranks:
            assert r[f"{key}/forward_log_probs_vs_naive"] <= 1e-5, r[f"{key}/forward_log_probs_vs_naive"]
        assert metrics["actor/ppo_kl"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0  # ratio exactly 1
    else:
        assert metrics["actor/pg_clipfrac"] > 0.05  # the clip is active on some tokens


def test_loss_path_selection_says_why():
    from mppo.config.schema import ActorConfig
    from mppo.workers.loss_selection import select_loss_path

    covered = select_loss_path(ActorConfig(use_kl_loss=True, entropy_coeff=0.01, loss_agg_mode="seq-mean-token-mean"))
    assert covered.fused and "kl_loss_type=low_var_kl" in covered.reason
    assert "fused gradient-in-forward kernel" in covered.describe()
    naive = select_loss_path(ActorConfig(logprob_impl="naive"))
    assert not naive.fused and "logprob_impl=naive" in naive.reason
    for mode in ("gspo", "geo_mean", "clip_cov", "kl_cov", "cispo", "sapo", "dppo_tv"):
        cfg = ActorConfig()
        cfg.policy_loss.loss_mode = mode
        path = select_loss_path(cfg)
        assert not path.fused and f"loss_mode={mode}" in path.reason and "reference path" in path.describe()
    # rollout correction's bypass mode replaces the policy loss: the kernel's PPO clip would be the wrong loss
    bypass = select_loss_path(ActorConfig(), rollout_correction_bypass=True)
    assert not bypass.fused and "bypass_mode" in bypass.reason
