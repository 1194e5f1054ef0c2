"""Separate placement and the off-policy pipeline (issue 26): `actor_rollout_ref.hybrid_engine=false` puts the
CPU engine on its own rank beside the trainer's, `async_training.max_off_policy_steps` = 0 (synchronous) or 1
(the engine generates step s+1 while step s trains).

References: the co-located 1-rank run of the same config (the real CLI under torchrun, as tests/test_trainer_e2e.py)
for k=0, which must give the same metrics; for k=1 the same step 1 (both generate it on the initial weights), then
responses one version old (staleness 1, a rollout-vs-actor gap far above the co-located run's) generated while the
previous step updated (the generation intervals the engine reports overlap the trainer's update phases); for a k=2
run killed with two generations in flight and restarted, the uninterrupted k=2 run, bit for bit. The same placements
with a real sglang.Engine (SGLang's CPU tier) on the engine rank: k=0's first step equals the co-located 1-rank
SGLang run's and the engine's log-probs equal the actor's after every sync across the split; k=1 gives the same
first step (top_k=1, so SGLang's sampling, which ignores per-sample seeds on the CPU, cannot depend on how the
scheduler batched the requests), then responses one version old."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_util import REPO
from dist_util import train_cli as train
from e2e_assets import dense_reward, make_assets, step_metrics, tiny_overrides

SEPARATE = ["actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.nnodes=1"]
NOT_COMPARED = ("timing_s/", "perf/", "async/trainer_idle", "async/engine_idle", "async/gen_overlap")
PARTIAL = ["async_training.max_off_policy_steps=1", "async_training.partial_rollout=true"]
# a slow engine (each decode step sleeps first): the trainer's update ends, and its new weights arrive, while the
# engine still generates the next batch (12 tokens: ~4.8 s; the update takes ~1.5 s, at 0.15 s a token the race
# was lost once on a loaded machine)
SLOW_ENGINE = {"MPPO_FAULT_SLOW_DECODE_S": "0.4"}


def load(overrides: list[str], world: int):
    from mppo.config import load_config

    return load_config(str(REPO / "configs" / "demo_cpu.yaml"), overrides, world_size=world)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def test_placement_splits_nodes():
    from mppo.parallel.placement import PlacementError, plan_placement

    shared = plan_placement(8, 4, trainer_nnodes=2, trainer_per_node=3, rollout_nnodes=2, rollout_per_node=1)
    assert shared.trainer_ranks == (0, 1, 2, 4, 5, 6) and shared.engine_ranks == (3, 7)
    assert shared.role(7) == "engine" and shared.side_rank(7) == 1 and shared.side_rank(4) == 3
    own = plan_placement(12, 4, trainer_nnodes=2, trainer_per_node=4, rollout_nnodes=1, rollout_per_node=4)
    assert own.trainer_ranks == tuple(range(8)) and own.engine_ranks == (8, 9, 10, 11)
    with pytest.raises(PlacementError, match="= 3, but the launch has 4 ranks"):
        plan_placement(4, 4, trainer_nnodes=1, trainer_per_node=2, rollout_nnodes=1, rollout_per_node=1)
    with pytest.raises(PlacementError, match="do not split"):
        plan_placement(8, 4, trainer_nnodes=1, trainer_per_node=3, rollout_nnodes=1, rollout_per_node=5)


def test_bad_placements_stop_in_one_line(assets, tmp_path):
    from mppo.config import ConfigError

    base = tiny_overrides(assets, tmp_path, world=1)
    cases = {
        "async_training.max_off_policy_steps = -1: must be >= 0": (SEPARATE + ["async_training.max_off_policy_steps=-1"], 2),
        "max_off_policy_steps = 1 needs actor_rollout_ref.hybrid_engine=false": (
            ["async_training.max_off_policy_steps=1"], 1),
        "= 1 x 1 + 1 x 1 = 2, but the launch has 3 ranks": (SEPARATE, 3),
        "actor_rollout_ref.rollout.n_gpus_per_node = 0": (SEPARATE + ["actor_rollout_ref.rollout.n_gpus_per_node=0"], 1),
        "multi_turn.enable=true with actor_rollout_ref.hybrid_engine=false": (
            SEPARATE + ["actor_rollout_ref.rollout.multi_turn.enable=true"], 2),
        "async_training.partial_rollout=true needs async_training.max_off_policy_steps >= 1": (
            SEPARATE + ["async_training.partial_rollout=true"], 2),
        "partial_rollout=true with actor_rollout_ref.actor.router_replay.mode=R3 is not built": (
            SEPARATE + PARTIAL + ["actor_rollout_ref.actor.router_replay.mode=R3"], 2),
    }
    for expected, (extra, world) in cases.items():
        with pytest.raises(ConfigError) as err:
            load(base + extra, world)
        assert expected in str(err.value) and "\n" not in str(err.value), (expected, str(err.value))
    # the trainer's DP is built over its own ranks: 1 trainer rank of a 2-rank launch is DP 1
    assert load(base + SEPARATE, 2).actor_rollout_ref.hybrid_engine is False
    # the CLI's --dry-run stops on the same line
    proc = subprocess.run([sys.executable, "-m", "mppo", "train", "configs/demo_cpu.yaml", *base, *SEPARATE,
                           "async_training.max_off_policy_steps=-1", "--dry-run"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2"}, timeout=120)
    assert proc.returncode != 0 and "async_training.max_off_policy_steps = -1" in proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory) -> dict[str, tuple[list[str], Path, dict[int, dict]]]:
    """The co-located 1-rank run and the separate runs at k=0, k=1 (3 steps), k=2 (4 steps: the resume test's
    reference) and k=1 with partial rollouts (4 steps): each one's overrides, run directory and metrics."""
    tmp = tmp_path_factory.mktemp("runs")
    # 2 mini-batches: the old-log-prob pass runs, so the rollout-vs-actor metrics are logged
    common = tiny_overrides(assets, tmp / "x", world=1, steps=3) + dense_reward(assets) + [
        "trainer.save_freq=-1", "trainer.test_freq=2"]
    plans = {"colocated": (1, []), "k0": (2, SEPARATE),
             "k1": (2, SEPARATE + ["async_training.max_off_policy_steps=1"]),
             "k2": (2, SEPARATE + ["async_training.max_off_policy_steps=2", "trainer.total_training_steps=4"]),
             "k1_partial": (2, SEPARATE + PARTIAL + ["trainer.total_training_steps=4"])}
    out = {}
    for name, (world, extra) in plans.items():
        overrides = common + extra + [f"trainer.default_local_dir={tmp / name}"]
        train(world, overrides, env=SLOW_ENGINE if name == "k1_partial" else None)
        out[name] = (overrides, tmp / name, step_metrics(tmp / name))
    return out


def test_separate_placement_sync_equals_colocated_and_one_step_off_policy_overlaps(runs):
    """1 trainer rank + 1 CPU-engine rank: k=0 gives the co-located 1-rank run's step 1-3 metrics (1e-4, with
    validation, the weight sync across the split each step); k=1 gives its step 1, then samples one version old,
    generated while the previous step updated."""
    co, k0, k1 = (runs[name][2] for name in ("colocated", "k0", "k1"))
    assert sorted(co) == sorted(k0) == sorted(k1) == [0, 1, 2, 3]
    assert co[0]["val/test_score/countdown"] == k0[0]["val/test_score/countdown"]
    for step in (1, 2, 3):
        keys = [k for k in co[step] if not k.startswith(NOT_COMPARED)]
        assert len(keys) > 30 and set(keys) <= set(k0[step]), set(keys) - set(k0[step])
        for key in keys:
            assert k0[step][key] == pytest.approx(co[step][key], rel=1e-4, abs=1e-6), (step, key)
        assert k0[step]["async/staleness/max"] == 0 and k0[step]["async/gen_overlap_s"] == 0
    # validation before step 1 and after step 2 pushed versions 0 and 2 already; step 2 pushes version 1
    assert [k0[step]["perf/weight_sync_bytes"] > 0 for step in (1, 2, 3)] == [False, True, False]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "training/rollout_probs_diff_max"):
        assert k1[1][key] == pytest.approx(co[1][key], rel=1e-4, abs=1e-6), key
    assert k1[1]["async/staleness/max"] == 0
    for step in (2, 3):
        assert k1[step]["async/staleness/mean"] == k1[step]["async/staleness/max"] == 1, step
        assert k1[step]["async/gen_overlap_s"] > 0, step  # this step's generation ran during the last update
        assert k1[step]["training/rollout_probs_diff_max"] > 10 * co[step]["training/rollout_probs_diff_max"]
        for key in ("async/trainer_idle_fraction", "async/engine_idle_fraction"):
            assert 0 <= k1[step][key] <= 1 and 0 <= k0[step][key] <= 1, (step, key)


SGLANG = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
          "actor_rollout_ref.rollout.top_k=1"]


@pytest.fixture(scope="module")
def sglang_runs(assets, tmp_path_factory) -> dict[str, dict[int, dict]]:
    """The co-located 1-rank run (1 step) and separate k=0 and k=1 runs (3 steps) on SGLang: each one's metrics."""
    tmp = tmp_path_factory.mktemp("sglang_runs")
    common = tiny_overrides(assets, tmp / "x", world=1, steps=3) + dense_reward(assets) + SGLANG + [
        "trainer.save_freq=-1", "trainer.test_freq=2"]
    plans = {"colocated": (1, ["trainer.total_training_steps=1"]), "k0": (2, SEPARATE),
             "k1": (2, SEPARATE + ["async_training.max_off_policy_steps=1"])}
    out = {}
    for name, (world, extra) in plans.items():
        train(world, common + extra + [f"trainer.default_local_dir={tmp / name}"])
        out[name] = step_metrics(tmp / name)
    return out


def test_sglang_on_the_separate_placement(sglang_runs):
    """1 trainer rank + 1 rank holding a real sglang.Engine: k=0 and k=1 give the co-located SGLang run's step 1
    (1e-4: all three generate it on the initial weights); at k=0 the engine's log-probs equal the actor's after
    every sync across the split (< 1e-6, the weights arrive whole each step); k=1 then trains on responses one
    version old."""
    co, k0, k1 = (sglang_runs[name] for name in ("colocated", "k0", "k1"))
    assert sorted(co) == [0, 1] and sorted(k0) == sorted(k1) == [0, 1, 2, 3]
    keys = [k for k in co[1] if not k.startswith(NOT_COMPARED + ("val/",))]  # the 1-step run validates at step 1
    assert len(keys) > 30 and set(keys) <= set(k0[1]) and set(keys) <= set(k1[1])
    for key in keys:
        assert k0[1][key] == pytest.approx(co[1][key], rel=1e-4, abs=1e-6), key
        assert k1[1][key] == pytest.approx(co[1][key], rel=1e-4, abs=1e-6), key
    for step in (1, 2, 3):
        assert k0[step]["training/rollout_probs_diff_max"] < 1e-6, step
        assert k0[step]["async/staleness/max"] == 0 and k0[step]["actor/grad_norm"] > 0, step
    for step in (2, 3):
        assert k1[step]["async/staleness/mean"] == k1[step]["async/staleness/max"] == 1, step
        assert k1[step]["training/rollout_probs_diff_max"] > 10 * k0[step]["training/rollout_probs_diff_max"], step


def test_two_step_off_policy_runs_up_to_two_versions_behind(runs):
    """k=2: step 1 is the co-located run's; steps 2 and 3 were both asked for after step 1's rollout, on the
    initial weights (staleness 1, then 2), step 4 after step 2's on version 1 (staleness 2): the engines took the
    next requests and the new weights while they generated."""
    co, k1, k2 = (runs[name][2] for name in ("colocated", "k1", "k2"))
    assert sorted(k2) == [0, 1, 2, 3, 4]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "training/rollout_probs_diff_max"):
        assert k2[1][key] == pytest.approx(co[1][key], rel=1e-4, abs=1e-6), key
    assert [k2[step]["async/staleness/max"] for step in (1, 2, 3, 4)] == [0, 1, 2, 2]
    assert [k2[step]["async/staleness/mean"] for step in (1, 2, 3, 4)] == [0, 1, 2, 2]
    # step 2's batch is k=1's (the same request on the same initial weights); step 3's is older than k=1's
    assert k2[2]["critic/score/mean"] == pytest.approx(k1[2]["critic/score/mean"], rel=1e-6)
    assert k2[3]["training/rollout_probs_diff_max"] > k1[3]["training/rollout_probs_diff_max"]


def test_partial_rollouts_go_on_on_the_new_weights(runs):
    """k=1 with partial rollouts and a slow engine: step 1 is the co-located run's; later, the trainer's new
    weights interrupt the generation of the next batch, which goes on on them. The tokens generated after an
    interruption have the engine probabilities of the weights the trainer holds (the actor's old log-probs: to
    1e-6), the earlier ones the last version's (a gap > 10x the co-located run's); staleness counts the oldest."""
    co, partial = runs["colocated"][2], runs["k1_partial"][2]
    assert sorted(partial) == [0, 1, 2, 3, 4]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "training/rollout_probs_diff_max"):
        assert partial[1][key] == pytest.approx(co[1][key], rel=1e-4, abs=1e-6), key
    assert partial[1]["async/partial/resumed_fraction"] == 0 and partial[1]["async/staleness/max"] == 0
    resumed = [step for step in (2, 3, 4) if partial[step]["async/partial/resumed_fraction"] > 0]
    assert resumed, {step: partial[step]["async/partial/resumed_fraction"] for step in (2, 3, 4)}
    on_policy_gap = max(co[step]["training/rollout_probs_diff_max"] for step in (1, 2, 3))
    for step in resumed:
        assert 0 < partial[step]["async/partial/newer_token_fraction"] < 1, step
        assert partial[step]["async/partial/current_version_probs_diff_max"] < 1e-6, step
        assert partial[step]["training/rollout_probs_diff_max"] > 10 * on_policy_gap, step
    for step in (2, 3, 4):
        assert partial[step]["async/staleness/max"] == 1, step


def test_off_policy_kill_and_resume_continues_identically(runs, tmp_path):
    """k=2, killed in step 3's actor update (the checkpoint after step 2 written with steps 3 and 4's generations
    in flight, on versions 0 and 1), then restarted: the resumed run trains steps 3 and 4 on the rollouts the
    checkpoint kept and its steps 3-4 (and everything before) equal the uninterrupted k=2 run's, to the bit (timing
    aside). A resume that regenerated them on the checkpoint's weights would be newer. (k=1 keeps one generation
    the same way: step 3's, on version 1.)"""
    from reliability_launch import train as launch

    overrides, _, want = runs["k2"]
    run_dir = tmp_path / "crashed"
    overrides = overrides + [f"trainer.default_local_dir={run_dir}", "trainer.save_freq=2"]
    # forked ranks: what is tested is the checkpoint's in-flight generations (torchrun's part: test_reliability_resume)
    killed = launch(overrides, env={"MPPO_FAULT": "kill@step:3:phase:update_actor"}, log=tmp_path / "killed.log",
                    timeout=900, forked=True)
    assert killed.returncode != 0 and "fault injection [rank 0]: kill at step 3" in killed.output, killed.output[-3000:]
    assert (run_dir / "checkpoints" / "global_step_2" / "in_flight" / "responses.safetensors").is_file()
    resumed = launch(overrides, log=tmp_path / "resumed.log", timeout=900, forked=True)
    assert resumed.returncode == 0, resumed.output[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'global_step_2'} (step 2)" in resumed.output
    for step, version in ((3, 0), (4, 1)):
        assert (f"restored the generation in flight at the checkpoint: step {step}'s responses (policy version "
                f"{version})") in resumed.output, resumed.output[-3000:]
    got = step_metrics(run_dir)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3, 4]
    for step in want:
        keys = {k for k in want[step] if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in got[step] if not k.startswith(NOT_COMPARED)}, step
        assert {k: got[step][k] for k in keys} == {k: want[step][k] for k in keys}, step
    assert got[3]["async/staleness/max"] == got[4]["async/staleness/max"] == 2
