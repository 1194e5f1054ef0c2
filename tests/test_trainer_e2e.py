"""End to end on CPU under torchrun: PPO (GAE + critic) and GRPO with TP=2 and PP=2, layout invariance of the
first step (also at CP=2), and resume. Each run is the real CLI (`mppo train configs/demo_cpu.yaml ...` on torchrun's
environment, through dist_util.train_cli)."""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_util import train_cli as train
from e2e_assets import dense_reward, make_assets, step_metrics, tiny_overrides

# Sampling, rewards and rollouts are identical across layouts; losses differ only by fp32 reduction order.
STEP1_KEYS = ("critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/advantages/max",
              "critic/returns/mean", "critic/values/mean", "critic/vf_loss", "actor/pg_loss", "actor/entropy",
              "actor/ppo_kl", "actor/grad_norm", "response_length/mean", "val/test_score/countdown")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def test_ppo_gae_layouts_agree_and_tp2_pp2_trains(assets, tmp_path):
    """Same seed ⇒ the same step-1 metrics at TP1×PP1 (1 rank), TP2×PP2 (4 ranks) and context parallelism CP2
    (2 ranks, SDPA attention: the demo's local attention has no CP); 3 steps run at TP2×PP2."""
    single, parallel, context = tmp_path / "tp1", tmp_path / "tp2pp2", tmp_path / "cp2"
    train(1, tiny_overrides(assets, single, world=1, steps=1) + dense_reward(assets))
    train(4, tiny_overrides(assets, parallel, world=4, tp=2, pp=2, steps=3) + dense_reward(assets))
    train(2, tiny_overrides(assets, context, world=2, steps=1) + dense_reward(assets)
          + ["actor_rollout_ref.actor.megatron.context_parallel_size=2",
             "actor_rollout_ref.model.transformer_impl=sdpa"])
    a, b, c = step_metrics(single), step_metrics(parallel), step_metrics(context)
    assert all(a[1][key] != 0 for key in ("critic/score/mean", "actor/grad_norm", "critic/vf_loss"))
    for key in STEP1_KEYS:
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-4, abs=1e-5), key
        assert c[1][key] == pytest.approx(a[1][key], rel=1e-4, abs=1e-5), f"cp2 {key}"
    assert a[0]["val/test_score/countdown"] == b[0]["val/test_score/countdown"]
    assert sorted(b) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in ("timing_s/weight_sync", "timing_s/gen", "timing_s/values", "timing_s/update_actor",
                    "perf/throughput", "perf/mfu", "critic/vf_loss", "actor/lr"):
            assert key in b[step], (step, key)
    assert (parallel / "metrics.png").stat().st_size > 1000
    assert (parallel / "checkpoints" / "global_step_3" / "manifest.json").is_file()


def test_grpo_tp2_and_resume_pp2(assets, tmp_path):
    """GRPO at TP=2 runs 3 steps; a PP=2 PPO run stopped after 2 steps and restarted continues exactly."""
    grpo = tmp_path / "grpo"
    train(2, tiny_overrides(assets, grpo, world=2, tp=2, steps=3, estimator="grpo", n=4) +
          ["critic.enable=false"])
    m = step_metrics(grpo)
    assert sorted(m) == [0, 1, 2, 3] and "critic/vf_loss" not in m[1]
    assert "critic/values/mean" not in m[1]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(2, tiny_overrides(assets, straight, world=2, pp=2, steps=3) + dense_reward(assets))
    train(2, tiny_overrides(assets, resumed, world=2, pp=2, steps=2) + dense_reward(assets))
    proc = train(2, tiny_overrides(assets, resumed, world=2, pp=2, steps=3) + dense_reward(assets))
    assert "resumed from" in proc.stderr
    s, r = step_metrics(straight), step_metrics(resumed)
    assert sorted(r) == [0, 1, 2, 3]
    for key, value in s[3].items():
        if not key.startswith(("timing_s/", "perf/")):
            assert r[3][key] == value, key


def test_bf16_model_checkpoints_and_resumes(assets, tmp_path):
    """bf16 parameters (the GPU default) on CPU, PPO with a critic: every parameter in bf16 (the critic's value
    head too, computed in fp32), the distributed optimizers' checkpoints are written after step 1 and a restart
    resumes from them (megatron-core cannot checkpoint a mixed-dtype model)."""
    run = tmp_path / "bf16"
    overrides = dense_reward(assets) + ["actor_rollout_ref.model.dtype=bf16"]
    train(1, tiny_overrides(assets, run, world=1, steps=1) + overrides)
    proc = train(1, tiny_overrides(assets, run, world=1, steps=2) + overrides)
    assert "resumed from" in proc.stderr
    m = step_metrics(run)
    assert sorted(m) == [0, 1, 2] and m[2]["actor/grad_norm"] > 0 and m[2]["critic/vf_loss"] > 0


def test_lora_grpo_tp2_with_kl_rollout_matches_actor(assets, tmp_path):
    """GRPO with LoRA (rank 8, all-linear) and the KL loss at TP2: the reference is the actor's base (no second
    model), the engine gets base + adapters merged, and its log-probs match the actor's after the adapters moved;
    each checkpoint holds the adapters (lora.json names the base)."""
    run = tmp_path / "lora"
    train(2, tiny_overrides(assets, run, world=2, tp=2, steps=3, estimator="grpo", n=4) + [
        "critic.enable=false", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.optim.lr=5e-3",
        "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.model.lora.target_modules=all-linear"] + dense_reward(assets))
    m = step_metrics(run)
    assert sorted(m) == [0, 1, 2, 3]
    # step 1 starts at B = 0 (the policy is the base = the reference); the adapters then move it away
    assert 0 < m[1]["actor/kl_loss"] < m[3]["actor/kl_loss"]
    for step in (1, 2, 3):
        # fp32: the merged weights are exact (measured ~3e-9); the engine serving the unmerged base gives ~1e-3
        assert m[step]["training/rollout_probs_diff_max"] < 1e-5, (step, m[step]["training/rollout_probs_diff_max"])
    actor_ckpt = run / "checkpoints" / "global_step_3" / "actor"
    assert (actor_ckpt / "lora.json").is_file()
