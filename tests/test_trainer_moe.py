"""PPO (GAE, with a critic) and GRPO (KL loss to a reference) on a tiny Qwen3-MoE (4 experts, top-2), CPU engine,
fp32, 2 ranks: at EP 2 (each rank holds 2 of the 4 experts of every layer, tokens dispatched all-to-all) the first
step's metrics and updated weights equal those at EP 1 (DP 2, every rank all experts); a run at EP 2 killed after
its checkpoint and resumed continues bit-identically. Routing replay (actor.router_replay.mode=R3): with the
engine's router weights perturbed (the honest mismatch source: the engine then routes some tokens to other
experts than the fp32 actor would), replaying the engine's routes shrinks training/rollout_probs_diff_max; R3 at
EP 2 equals EP 1. With moe_aux_loss_coeff / moe_z_loss_coeff set, actor/ and critic/moe_aux_loss, moe_z_loss are
in the step's metrics. On 4 ranks: TP 2 x EP 2 with sequence parallelism equals TP 1 x EP 1, also with R3.

The reference for EP 2 is the EP 1 run: the same model, seed, prompts and rollouts (the engine seeds every sample
by its global index), with the experts in one place. One torchrun launch runs the 2-rank cases, another the 4-rank.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_util import REPO, run_torchrun
from e2e_assets import dense_reward, make_assets, step_metrics, tiny_overrides
from reliability_launch import TIMING_PREFIXES

EP2 = ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]
R3 = ["actor_rollout_ref.actor.router_replay.mode=R3"]
AUX = ["actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
       "actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff=0.001"]
LORA = ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.model.lora.target_modules=[all-linear]"]  # attention, the dense MLP and every expert
PERTURBED = "step_engine_routers_perturbed"  # tests/dist/trainer_moe.py: the engine's routers slightly off


def _cases(root: Path) -> dict:
    common = dense_reward(root) + ["trainer.val_before_train=false", "trainer.test_freq=-1",
                                   "actor_rollout_ref.actor.optim.lr=1e-3"]
    grpo = tiny_overrides(root, root / "grpo", world=2, steps=1, estimator="grpo", n=4) + common + [
        "critic.enable=false", "algorithm.use_kl_in_reward=false", "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.save_freq=-1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    ppo = tiny_overrides(root, root / "ppo", world=2, steps=1, estimator="gae") + common + [
        "trainer.save_freq=-1", "critic.optim.lr=1e-3"]
    resume = tiny_overrides(root, root / "unused", world=2, estimator="gae") + common + EP2 + ["trainer.save_freq=1"]
    return {
        "grpo_ep1": ["step", grpo, None],
        "grpo_ep2": ["step", grpo + EP2, "grpo_ep1"],
        "ppo_ep1": ["step", ppo, None],
        "ppo_ep2": ["step", ppo + EP2, "ppo_ep1"],
        "grpo_lora_ep1": ["step", grpo + LORA, None],
        "grpo_lora_ep2": ["step", grpo + LORA + EP2, "grpo_lora_ep1"],
        # routing replay: GRPO takes the old log-probs from the update's forward, PPO (2 mini-batches) from an
        # old-log-prob pass; the engine's routers are perturbed in all four
        "grpo_mismatch": [PERTURBED, grpo, None],
        "grpo_mismatch_r3": [PERTURBED, grpo + R3, None],
        "grpo_mismatch_r3_ep2": [PERTURBED, grpo + R3 + EP2, "grpo_mismatch_r3"],
        "ppo_mismatch": [PERTURBED, ppo, None],
        "ppo_mismatch_r3": [PERTURBED, ppo + R3, None],
        "ppo_aux": ["step", ppo + AUX, None],
        "straight": ["fit", resume + [f"trainer.default_local_dir={root / 'straight'}",
                                      "trainer.total_training_steps=2"], None],
        "first": ["fit", resume + [f"trainer.default_local_dir={root / 'resumed'}",
                                   "trainer.total_training_steps=1"], None],
        "resumed": ["fit", resume + [f"trainer.default_local_dir={root / 'resumed'}",
                                     "trainer.total_training_steps=2"], None],
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = make_assets(tmp_path_factory.mktemp("moe_assets"), arch="qwen3_moe")
    ranks = run_torchrun(REPO / "tests" / "dist" / "trainer_moe.py", 2, root / "out",
                         ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--cases", json.dumps(_cases(root))],
                         timeout=900)
    return root, ranks


@pytest.fixture(scope="module")
def run_tp(run) -> list[dict]:
    """PPO (GAE + critic) on 4 ranks: TP1 x EP1 (DP4) against TP2 x EP2 with sequence parallelism (megatron-core
    trains MoE layers under TP only with it; DP2, the experts split over the DP pair, each expert's weights over the
    TP pair). One mini-batch per step: how a step's samples fall into mini-batches depends on DP (veRL's split:
    DP shards first), one optimizer step on all of them does not. A second launch: the cases above need 2 ranks."""
    root, _ = run
    common = dense_reward(root) + ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
                                   "actor_rollout_ref.actor.optim.lr=1e-3", "critic.optim.lr=1e-3",
                                   "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    ppo = tiny_overrides(root, root / "ppo_tp", world=4, steps=1, estimator="gae", n=2) + common
    tp2 = EP2 + ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    cases = {"ppo_tp1ep1": ["step", ppo, None],
             "ppo_tp2ep2sp": ["step", ppo + tp2, "ppo_tp1ep1"],
             # routing replay: each TP rank replays its slice of the sequence (the MoE losses under SP are checked
             # against naive formulas in tests/test_moe_router.py; here SP's padding to a multiple of TP would
             # enter them)
             "ppo_r3_tp1ep1": [PERTURBED, ppo + R3, None],
             "ppo_r3_tp2ep2sp": [PERTURBED, ppo + R3 + tp2, "ppo_r3_tp1ep1"]}
    return run_torchrun(REPO / "tests" / "dist" / "trainer_moe.py", 4, root / "out_tp",
                        ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--cases", json.dumps(cases)],
                        timeout=900)


@pytest.mark.parametrize("case", ["ppo", "ppo_r3"])
def test_first_step_at_tp2_ep2_with_sequence_parallelism_equals_tp1_ep1(run_tp, case):
    for r in run_tp:
        tp1, tp2 = _computed(r[f"{case}_tp1ep1"]["metrics"]), _computed(r[f"{case}_tp2ep2sp"]["metrics"])
        assert set(tp1) == set(tp2)
        assert tp1["actor/grad_norm"] > 1 and tp1["critic/vf_loss"] > 0
        for key, value in tp1.items():
            assert tp2[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
        assert r[f"{case}_tp2ep2sp"]["weights_diff"] <= 1e-5


def _computed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(TIMING_PREFIXES)}


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_first_step_at_ep2_equals_ep1(run, algorithm):
    _, ranks = run
    for r in ranks:
        ep1, ep2 = _computed(r[f"{algorithm}_ep1"]["metrics"]), _computed(r[f"{algorithm}_ep2"]["metrics"])
        assert set(ep1) == set(ep2)
        assert ep1["actor/grad_norm"] > 1  # a real update (fp32, dense reward)
        for key, value in ep1.items():
            assert ep2[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
        assert r[f"{algorithm}_ep2"]["weights_diff"] <= 1e-5  # after one Adam step at lr 1e-3


def test_lora_on_the_experts_trains_the_same_at_ep2(run):
    """GRPO with LoRA on every linear, the experts' included (their adapters reduced over the expert-data-parallel
    group, as megatron does the experts' weights): EP2 equals EP1 (metrics 1e-4; the merged HF weights after the
    update 1e-5, so the adapters moved alike), the engine got the merged weights (its probabilities equal the
    actor's < 1e-3)."""
    _, ranks = run
    for r in ranks:
        ep1, ep2 = _computed(r["grpo_lora_ep1"]["metrics"]), _computed(r["grpo_lora_ep2"]["metrics"])
        assert set(ep1) == set(ep2)
        assert ep1["actor/grad_norm"] > 0.01  # B = 0 at the start: only B has a gradient
        for key, value in ep1.items():
            assert ep2[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
        assert r["grpo_lora_ep2"]["weights_diff"] <= 1e-5
        assert ep1["training/rollout_probs_diff_max"] < 1e-3


def test_resume_at_ep2_continues_bit_identically(run):
    root, ranks = run
    assert [r["straight"]["resumed_from"] for r in ranks] == [None, None]
    assert [r["resumed"]["resumed_from"] for r in ranks] == [1, 1]  # the second launch of the run: from step 1
    straight, resumed = step_metrics(root / "straight"), step_metrics(root / "resumed")
    assert sorted(straight) == sorted(resumed) == [1, 2]
    for step in (1, 2):
        assert _computed(resumed[step]) == _computed(straight[step]), step


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_routing_replay_brings_the_actors_log_probs_to_the_engines(run, algorithm):
    """The engine serves router weights off the actor's by 5% of their std (tests/dist/trainer_moe.py): without
    replay some tokens go to other experts in the actor than in the engine; with the engine's routes replayed
    only the small difference of the routing weights is left."""
    _, ranks = run
    for r in ranks:
        off = r[f"{algorithm}_mismatch"]["metrics"]["training/rollout_probs_diff_max"]
        on = r[f"{algorithm}_mismatch_r3"]["metrics"]["training/rollout_probs_diff_max"]
        print(f"{algorithm}: training/rollout_probs_diff_max without replay {off:.3e}, with R3 {on:.3e}")
        assert on < off / 5, (on, off)
    rank0, rank1 = (_computed(r[f"{algorithm}_mismatch"]["metrics"]) for r in ranks)
    assert rank0 == rank1  # timings and throughputs are each rank's own


def test_routing_replay_at_ep2_equals_ep1(run):
    _, ranks = run
    for r in ranks:
        ep1, ep2 = _computed(r["grpo_mismatch_r3"]["metrics"]), _computed(r["grpo_mismatch_r3_ep2"]["metrics"])
        assert set(ep1) == set(ep2)
        for key, value in ep1.items():
            assert ep2[key] == pytest.approx(value, rel=1e-4, abs=1e-4), key
        assert r["grpo_mismatch_r3_ep2"]["weights_diff"] <= 1e-5


def test_moe_aux_losses_are_reported_when_on(run):
    _, ranks = run
    for r in ranks:
        on, off = r["ppo_aux"]["metrics"], r["ppo_ep1"]["metrics"]
        for key in ("actor/moe_aux_loss", "actor/moe_z_loss", "critic/moe_aux_loss", "critic/moe_z_loss"):
            assert key not in off
            assert on[key] > 0, key
