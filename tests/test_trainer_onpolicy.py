"""On-policy steps take the old log-probs from the actor update's own forward (`actor.reuse_on_policy_log_prob`).

The reference is the recompute path (a separate no-grad forward before the update, as every off-policy step does):
on the first step, with the same initial weights and rollouts, both must give the same update. Off-policy
updates (2 epochs, 2 mini-batches) and uses of the old log-probs before the update keep the separate pass.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_util import REPO, run_torchrun
from e2e_assets import make_assets, tiny_overrides

# A reward that varies between the samples of a prompt, so GRPO's advantages (and the gradient) are not zero.
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (sum(map(ord, solution_str)) % 11) / 10
'''


def base_overrides(root: Path, run_dir: Path, world: int) -> list[str]:
    (root / "reward.py").write_text(REWARD)
    return tiny_overrides(root, run_dir, world=world, steps=1, estimator="grpo", n=4) + [
        "critic.enable=false", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.entropy_coeff=0.01",
        f"reward.custom_fn.path={root}/reward.py", "trainer.val_before_train=false", "trainer.test_freq=-1"]


def load(overrides: list[str], world: int = 1):
    from mppo.config import load_config

    return load_config(str(REPO / "configs" / "demo_cpu.yaml"), overrides, world_size=world)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def test_reuse_decision_names_what_needs_the_separate_pass(assets, tmp_path):
    """Reuse only when on-policy and nothing reads old log-probs before the update; the reason otherwise."""
    from mppo.config.decisions import old_log_prob_reuse

    base = base_overrides(assets, tmp_path, world=1)
    assert old_log_prob_reuse(load(base)) == (True, "")
    cases = {
        "actor.reuse_on_policy_log_prob=false": ["actor_rollout_ref.actor.reuse_on_policy_log_prob=false"],
        "ppo_epochs=2": ["actor_rollout_ref.actor.ppo_epochs=2"],
        "2 mini-batches": ["actor_rollout_ref.actor.ppo_mini_batch_size=4"],
        "use_kl_in_reward": ["algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=false"],
        "optimal_token_baseline": ["algorithm.adv_estimator=optimal_token_baseline"],
        "needs them for the IS weights and rejection": ["algorithm.rollout_correction.rollout_is=token"],
        "rollout_rs=seq_mean_k3": ["algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                                   "algorithm.rollout_correction.rollout_rs_threshold=0.01"],
        "bypass_mode=true takes them from the rollout engine": ["algorithm.rollout_correction.bypass_mode=true"],
    }
    for expected, extra in cases.items():
        reuse, why = old_log_prob_reuse(load(base + extra))
        assert not reuse and expected in why, (expected, why)


def test_reuse_equals_recompute_and_off_policy_keeps_the_pass(assets, tmp_path):
    """DP=2, GRPO with a KL loss and an entropy bonus: the first update with the old log-probs taken from its own
    forward equals the update with them recomputed before it (losses, grad norm, updated weights), and the
    old-log-prob phase disappears; with 2 epochs or 2 mini-batches the trainer recomputes them (the phase runs)
    and the actor refuses to take them from its forward. The rollout-vs-actor mismatch metrics are logged
    either way (and at PP 2), tiny in fp32 and the same from either source."""
    base = base_overrides(assets, tmp_path / "run", world=2)
    ranks = run_torchrun(REPO / "tests" / "dist" / "trainer_onpolicy.py", 2, tmp_path / "out",
                         ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--overrides", json.dumps(base)],
                         timeout=300)
    for r in ranks:
        reuse, recompute = r["reuse"], r["recompute"]
        assert reuse["reuse"] is True and recompute["reuse"] is False
        a, b = reuse["metrics"], recompute["metrics"]
        assert "timing_s/old_log_prob" not in a and "timing_s/old_log_prob" in b
        # same rollouts and rewards, with advantages that are not all zero
        for key in ("critic/score/mean", "critic/score/max", "response_length/mean", "critic/advantages/max"):
            assert a[key] == b[key], key
        assert a["critic/advantages/max"] > 0
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), key
        assert a["actor/grad_norm"] > 1e-3 and reuse["weights_moved"] > 1e-4
        assert r["weights_max_abs_diff"] <= 1e-6
        assert a["actor/ppo_kl"] == 0.0 and a["actor/pg_clipfrac"] == 0.0  # ratio is exactly 1
        assert abs(b["actor/ppo_kl"]) <= 1e-6
        for name in ("two_epochs", "two_mini_batches"):
            case = r[name]
            assert case["reuse"] is False and "timing_s/old_log_prob" in case["metrics"], name
            assert "needs one epoch over one mini-batch" in case["actor_refused"], name
        # Rollout vs actor probabilities (fp32, CPU engine, same weights): tiny mismatch with or without the
        # reuse, the same global value on every rank and from either source of old log-probs.
        pp2 = r["reuse_pp2"]
        assert pp2["reuse"] is True and "timing_s/old_log_prob" not in pp2["metrics"]
        for case in (a, b, pp2["metrics"], r["two_epochs"]["metrics"]):
            assert case["training/rollout_probs_diff_valid"] == 1.0
            assert 0.0 <= case["training/rollout_probs_diff_max"] < 1e-3
            assert case["training/rollout_actor_probs_pearson_corr"] > 0.999
        for key in ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
                    "training/rollout_probs_diff_std", "training/rollout_actor_probs_pearson_corr"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-7), key
            assert a[key] == ranks[0]["reuse"]["metrics"][key] and b[key] == ranks[0]["recompute"]["metrics"][key]
