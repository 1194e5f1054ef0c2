"""The suite's one SGLang launch (session-scoped fixture `sglang_launch`, made available by conftest.py): SGLang's
start-up is the slow part on the CPU, so tests/test_rollout_sglang_cpu.py and tests/test_trainer_sglang.py share one
torchrun launch of tests/dist/trainer_sglang.py (2 ranks). It first runs the rollout tier's engine checks
(tests/dist/sglang_tier.py; one model family per rank, in parallel), then the trainers on shared engines: four on a
tiny Llama (PPO and GRPO at trainer TP2 and DP2, 3 steps each) and GRPO at EP2 with routing replay on a tiny
Qwen3-MoE (2 steps). Returns {"ranks": each rank's results, "tier_dir": where the tier wrote its files}."""
from __future__ import annotations

import json

import pytest

SGLANG = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
          "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=true"]
OFFLOAD = ["actor_rollout_ref.actor.megatron.param_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true"]
MOE_R3 = ["critic.enable=false", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
          "actor_rollout_ref.actor.router_replay.mode=R3"]


@pytest.fixture(scope="session")
def sglang_launch(tmp_path_factory) -> dict:
    from dist_util import REPO, run_torchrun  # here: conftest imports this module in every session
    from e2e_assets import dense_reward, make_assets, step_metrics, tiny_overrides

    root = tmp_path_factory.mktemp("sglang")
    assets = make_assets(root / "assets", arch="llama")
    runs = root / "runs"
    common = dense_reward(assets) + SGLANG
    cases = {
        "tp2_ppo": tiny_overrides(assets, runs / "tp2_ppo", world=2, tp=2, steps=3) + common,
        "tp2_grpo": tiny_overrides(assets, runs / "tp2_grpo", world=2, tp=2, steps=3, estimator="grpo", n=4)
        + common + ["critic.enable=false"],
        "dp2_ppo": tiny_overrides(assets, runs / "dp2_ppo", world=2, steps=3) + common + OFFLOAD,
        "dp2_grpo": tiny_overrides(assets, runs / "dp2_grpo", world=2, steps=3, estimator="grpo", n=4)
        + common + ["critic.enable=false"],
    }
    moe = make_assets(root / "moe_assets", arch="qwen3_moe")
    cases["ep2_grpo_r3"] = (tiny_overrides(moe, runs / "ep2_grpo_r3", world=2, steps=2, estimator="grpo", n=4)
                            + dense_reward(moe) + SGLANG + MOE_R3)
    tier_dir = root / "tier"
    ranks = run_torchrun(REPO / "tests" / "dist" / "trainer_sglang.py", 2, root / "out",
                         ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--cases", json.dumps(cases),
                          "--tier-dir", str(tier_dir)], timeout=2400)
    for name in cases:
        ranks[0][name]["metrics"] = step_metrics(runs / name)
    return {"ranks": ranks, "tier_dir": tier_dir}
