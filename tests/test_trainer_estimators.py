"""Every advantage estimator that validates also runs: 2 trainer steps each, in one torchrun launch.

ReMax's baselines are checked against HF transformers' greedy generation of the same prompts (scored by the run's
reward function) and the optimal-token-baseline inputs (sum over the vocabulary of p^2, old log-probs) against
HF logits of the same sequences; see tests/dist/trainer_estimators.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dist_util import REPO, run_torchrun
from e2e_assets import dense_reward, make_assets, tiny_overrides
from test_batch_schema import check_batch_specs

N = 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def test_every_registered_estimator_runs_two_steps(assets, tmp_path):
    from mppo.core_algos import ADV_ESTIMATOR_REGISTRY

    base = tiny_overrides(assets, tmp_path / "run", world=1, steps=2, n=N) + dense_reward(assets) + [
        "critic.enable=null", "algorithm.use_kl_in_reward=false", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "data.max_response_length=8"]
    (result,) = run_torchrun(REPO / "tests" / "dist" / "trainer_estimators.py", 1, tmp_path / "out",
                             ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--overrides", json.dumps(base)])
    assert sorted(result) == sorted(ADV_ESTIMATOR_REGISTRY)
    for name, case in result.items():
        assert len(case["steps"]) == 2, name
        for metrics in case["steps"]:
            assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"]), name
        assert case["steps"][0]["actor/grad_norm"] > 0, name
        assert case["advantages_finite"] and case["advantages_nonzero"], name
        assert ("reward_baselines" in case["batch_keys"]) == (name == "remax"), name
        assert ("sum_pi_squared" in case["batch_keys"]) == name.endswith("optimal_token_baseline"), name
        check_batch_specs(case["batch_specs"])  # the update's batch is the declared one (mppo.workers.batch_schema)

    remax = result["remax"]
    expected = [b for b in remax["hf_greedy_baselines"] for _ in range(N)]
    assert remax["reward_baselines"] == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert remax["reward_baselines"] != pytest.approx(remax["scores"])  # not the sampled responses' own scores
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        case = result[name]
        assert case["sum_pi_squared_max_err"] < 1e-5, name
        assert case["sum_pi_squared_off_mask_max"] == 0.0, name
        assert case["old_log_probs_max_err"] < 1e-4, name
        low, high = case["sum_pi_squared_range"]
        assert 0 < low <= high < 1, name
