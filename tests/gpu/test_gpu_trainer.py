"""The whole PPO loop on one GPU (nccl, megatron actor/critic/ref on CUDA, Triton log-prob kernel) vs the same run
on the CPU: the first step's metrics must agree (rollouts come from the CPU engine in both, so samples and scores
are identical and the losses differ only by device arithmetic). Then GRPO in bf16 runs and stays finite, and, where
SGLang is installed, PPO runs on a real SGLang engine on the GPU (CUDA IPC weight pushes, memory saver, offload)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_util import REPO, free_port
from e2e_assets import dense_reward, make_assets, step_metrics, tiny_overrides
from gpu_report import report

STEP1_KEYS = ("critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
              "critic/values/mean", "critic/vf_loss", "actor/pg_loss", "actor/entropy", "actor/ppo_kl",
              "actor/grad_norm", "response_length/mean", "val/test_score/countdown")


def train(overrides: list[str], *, gpu: bool) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "mppo", "train", "configs/demo_cpu.yaml", *overrides,
           f"trainer.device={'cuda' if gpu else 'cpu'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "4",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"), hidden=64)


def test_ppo_step_on_gpu_matches_cpu(assets, tmp_path):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    train(tiny_overrides(assets, cpu, world=1, steps=2) + dense_reward(assets), gpu=False)
    train(tiny_overrides(assets, gpu, world=1, steps=2) + dense_reward(assets)
          + ["actor_rollout_ref.actor.kernel_backend=triton"], gpu=True)
    a, b = step_metrics(cpu), step_metrics(gpu)
    assert all(a[1][key] != 0 for key in ("critic/score/mean", "actor/grad_norm", "critic/vf_loss"))
    report("trainer_ppo_cpu_vs_gpu", {k: {"cpu": a[1].get(k), "gpu": b[1].get(k)} for k in STEP1_KEYS}
           | {"gpu_timing_step2": {k: v for k, v in b[2].items() if k.startswith(("timing_s/", "perf/"))}})
    for key in STEP1_KEYS:
        assert b[1][key] == pytest.approx(a[1][key], rel=2e-3, abs=2e-4), key
    assert sorted(b) == [0, 1, 2]


def test_grpo_bf16_on_gpu_runs(assets, tmp_path):
    run = tmp_path / "grpo_bf16"
    train(tiny_overrides(assets, run, world=1, steps=3, estimator="grpo", n=4) + dense_reward(assets)
          + ["actor_rollout_ref.model.dtype=bf16", "actor_rollout_ref.actor.kernel_backend=triton"], gpu=True)
    m = step_metrics(run)
    report("trainer_grpo_bf16", {s: {k: v for k, v in m[s].items() if not k.startswith("timing")} for s in m})
    assert sorted(m) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
            assert math.isfinite(m[step][key]), (step, key)
        assert m[step]["actor/grad_norm"] > 0, step


def test_ppo_on_a_sglang_engine_on_gpu(assets, tmp_path):
    """rollout.name=sglang on the GPU: a real sglang.Engine of TP 1 with the memory saver, weights pushed through
    CUDA IPC every step, the trainer state offloaded while it generates; 3 PPO steps in bf16 whose rollouts come
    from the weights the actor has (the engine's token probabilities match the actor's)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed on this GPU machine (pip install 'mppo[gpu]')")
    run = tmp_path / "sglang"
    proc = train(tiny_overrides(assets, run, world=1, steps=3) + dense_reward(assets) + [
        "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.model.dtype=bf16",
        "actor_rollout_ref.actor.kernel_backend=triton", "actor_rollout_ref.actor.megatron.param_offload=true",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true"], gpu=True)
    m = step_metrics(run)
    report("trainer_ppo_sglang_gpu", {s: {k: v for k, v in m[s].items() if not k.startswith("timing")} for s in m}
           | {"stderr_tail": proc.stderr[-2000:]})
    assert sorted(m) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/score/mean"):
            assert math.isfinite(m[step][key]), (step, key)
        assert m[step]["actor/grad_norm"] > 0 and m[step]["perf/weight_sync_bytes"] > 0, step
        assert m[step]["training/rollout_probs_diff_max"] < 0.1, step  # bf16 engine vs bf16 actor


def test_grpo_with_lora_adapters_only_on_a_sglang_engine_on_gpu(assets, tmp_path):
    """LoRA with lora.merge=false on the GPU: the engine starts with SGLang's LoRA support (its GPU backend), takes
    the base once and only the adapters at every later sync, and keeps the base through each release while the
    memory saver frees its KV cache; 3 GRPO steps whose rollouts match the actor's adapted policy."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed on this GPU machine (pip install 'mppo[gpu]')")
    run = tmp_path / "sglang_lora"
    proc = train(tiny_overrides(assets, run, world=1, steps=3, estimator="grpo", n=4) + dense_reward(assets) + [
        "critic.enable=false", "actor_rollout_ref.rollout.name=sglang",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.model.lora.merge=false", "actor_rollout_ref.actor.optim.lr=0.01"], gpu=True)
    m = step_metrics(run)
    report("trainer_grpo_lora_adapters_sglang_gpu", {s: {k: v for k, v in m[s].items() if not k.startswith("timing")}
                                                     for s in m} | {"stderr_tail": proc.stderr[-2000:]})
    assert sorted(m) == [0, 1, 2, 3]
    for step in (1, 2, 3):
        assert m[step]["actor/grad_norm"] > 0, step
        assert m[step]["training/rollout_probs_diff_max"] < 1e-2, step  # fp32 actor, fp32 engine
    assert m[2]["perf/weight_sync_bytes"] < m[1]["perf/weight_sync_bytes"] / 10  # adapters only after the base
