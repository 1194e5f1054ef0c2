"""Multi-node launch simulated on one machine: `launch/slurm.sbatch` itself runs under a fake `scontrol` (two
nodes whose first name is 127.0.0.1) and a fake `srun` that starts the per-node command as two concurrent
processes, as Slurm would on two hosts. Each is a separate torchrun agent; they meet at a c10d rendezvous on
127.0.0.1 and train 2 PPO steps at TP=2 inside a node and DP=2 across nodes. The reference is the same layout
launched as 4 ranks on one node (tests/dist_util.launch, with torchrun's environment): same global ranks, same
groups, same gloo reductions, so every metric that is not a clock reading must be bit-identical. A dense custom
reward makes the compared numbers real (the random model never solves countdown, so the built-in score, advantages
and gradients would all be zero).

Also: every rank logs its host, global rank and TP/PP/DP coordinates at start-up, and a node that cannot reach
the rendezvous fails in bounded time with the address and port in its output, through torchrun itself and
through the sbatch script's probe.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_util import REPO, free_port, train_cli
from e2e_assets import dense_reward, make_assets, step_metrics, tiny_overrides

NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE
# Clock and memory readings (and rates derived from them) legitimately differ between two runs; everything else
# may not.
CLOCK_KEYS = ("timing_s/", "perf/mfu", "perf/throughput", "perf/time_per_step", "perf/weight_sync_gb_per_s",
              "perf/cpu_memory_peak_gb", "perf/max_memory_")

# Dense and sample-dependent, so advantages, losses and gradients are far from zero at step 1.

FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || { echo "fake scontrol: unexpected arguments: $*" >&2; exit 1; }
printf '%s\\n' 127.0.0.1 localhost
"""
# srun: one task per node, started concurrently like Slurm does on real nodes, each with the variables Slurm gives
# a task and its output in --output (%n = node index). --kill-on-bad-exit: the first failing node stops the others.
FAKE_SRUN = """#!/usr/bin/env bash
nodes="" output=""
while [[ "$1" == -* ]]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}";; --output=*) output="${1#--output=}";; esac
  shift
done
[[ "$nodes" == "$SLURM_NNODES" ]] || { echo "fake srun: --nodes=$nodes but SLURM_NNODES=$SLURM_NNODES" >&2; exit 1; }
pids=()
for (( node = 0; node < nodes; node++ )); do
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$nodes SLURMD_NODENAME="node$node" \\
    "$@" > "${output//%n/$node}" 2>&1 &
  pids+=("$!")
done
rc=0
for _ in "${pids[@]}"; do
  wait -n; status=$?
  if (( status != 0 && rc == 0 )); then
    rc=$status
    kill -TERM "${pids[@]}" 2>/dev/null
  fi
done
exit $rc
"""

LAYOUT_LINE = re.compile(r"\[rank (\d+)\] INFO parallel layout: rank (\d+)/(\d+) on (\S+) \((\w+), (\w+)\): "
                         r"tp (\d+)/(\d+) pp (\d+)/(\d+) dp (\d+)/(\d+)")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"), train_size=16, test_size=8)


def run_overrides(assets: Path, run_dir: Path, per_node: int) -> list[str]:
    """2 steps of the demo config at TP=2, validation only after the last step, the dense reward."""
    return tiny_overrides(assets, run_dir, world=per_node, tp=2, steps=2) + [
        "trainer.test_freq=2", "trainer.val_before_train=false", "data.val_batch_size=8",
        *dense_reward(assets), "trainer.collective_timeout_s=120"]


def run_group(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """Run `cmd` in its own session; on timeout SIGTERM the session (torchrun agents then stop their workers)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        out += f"\n[test: killed after {timeout} s]"
    return proc.returncode, out, time.monotonic() - start


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def sbatch_env(tmp_path: Path, port: int, **extra: str) -> tuple[dict[str, str], Path]:
    """PATH with the fake srun/scontrol first, then this interpreter's torchrun; Slurm's variables for 2 nodes."""
    fake_bin, logs = tmp_path / "bin", tmp_path / "logs"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    env = base_env(PATH=f"{fake_bin}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                   SLURM_JOB_ID="7001", SLURM_JOB_NAME="mppo-sim", SLURM_NNODES=str(NODES),
                   SLURM_JOB_NODELIST="node[0-1]", SLURM_GPUS_ON_NODE=str(RANKS_PER_NODE),
                   SLURM_CPUS_ON_NODE=str(RANKS_PER_NODE), MASTER_PORT=str(port), LOG_DIR=str(logs), **extra)
    return env, logs


def layout_lines(text: str) -> dict[int, dict]:
    """Global rank -> what its start-up line says."""
    found = {}
    for m in LAYOUT_LINE.finditer(text):
        tag, rank, world, host, backend, _, tp, tps, pp, pps, dp, dps = m.groups()
        assert tag == rank, m.group(0)  # the log tag and the line agree on who is speaking
        found[int(rank)] = {"world": int(world), "host": host, "backend": backend, "tp": (int(tp), int(tps)),
                                "pp": (int(pp), int(pps)), "dp": (int(dp), int(dps))}
    return found


def test_two_node_launch_matches_single_node(assets, tmp_path):
    """sbatch → 2 torchrun agents (2 ranks each) on a c10d rendezvous == 4 ranks on one node, metric for metric."""
    single_dir, multi_dir = tmp_path / "single", tmp_path / "multi"
    # the reference's ranks get torchrun's environment from dist_util.launch (the launcher is not its subject)
    single = train_cli(WORLD, run_overrides(assets, single_dir, per_node=WORLD), timeout=240)
    single_out = single.stdout + single.stderr

    port = free_port()
    env, logs = sbatch_env(tmp_path, port, RDZV_TIMEOUT="60")
    cmd = ["bash", str(REPO / "launch/slurm.sbatch"), "configs/demo_cpu.yaml",
           *run_overrides(assets, multi_dir, per_node=RANKS_PER_NODE)]
    rc, sbatch_out, _ = run_group(cmd, env, timeout=240)
    node_logs = [(logs / f"node{n}.log").read_text() if (logs / f"node{n}.log").exists() else "" for n in range(NODES)]
    report = sbatch_out + "".join(f"\n===== node{n}.log\n{text[-5000:]}" for n, text in enumerate(node_logs))
    assert rc == 0, f"2-node run failed ({rc}):\n{report}"
    assert f"{NODES} node(s) x {RANKS_PER_NODE} GPUs, rendezvous 127.0.0.1:{port}" in sbatch_out

    # Start-up lines: every rank of both runs says its host, global rank and coordinates.
    host = socket.gethostname()
    for text in (single_out, "".join(node_logs)):
        ranks = layout_lines(text)
        assert sorted(ranks) == list(range(WORLD)), text[-4000:]
        for rank, line in ranks.items():
            # megatron's order: TP fastest, then DP (PP=1)
            assert line == {"world": WORLD, "host": host, "backend": "gloo", "tp": (rank % 2, 2), "pp": (0, 1),
                                "dp": (rank // 2, 2)}, (rank, line)
    # Each node runs one whole TP group, so TP stays inside a node and DP spans the two nodes.
    node_ranks = [sorted(layout_lines(text)) for text in node_logs]
    assert sorted(map(tuple, node_ranks)) == [(0, 1), (2, 3)], node_ranks
    for n, text in enumerate(node_logs):
        assert f"mppo node {n}/{NODES} on " in text and f"rendezvous 127.0.0.1:{port}" in text

    a, b = step_metrics(single_dir), step_metrics(multi_dir)
    assert sorted(a) == sorted(b) == [1, 2]
    for step in (1, 2):
        assert a[step].keys() == b[step].keys(), step
        compared = {k: v for k, v in a[step].items() if not k.startswith(CLOCK_KEYS)}
        assert {k: b[step][k] for k in compared} == compared, step
    # the comparison has teeth: rewards vary, so the actor and critic really moved at step 1
    assert a[1]["critic/score/max"] > a[1]["critic/score/min"] and a[1]["actor/grad_norm"] > 1e-3
    assert a[1]["critic/grad_norm"] > 1e-3 and "val/test_score/countdown" in a[2]
    assert (multi_dir / "checkpoints" / "global_step_2" / "manifest.json").is_file()


def test_torchrun_node_that_cannot_reach_the_rendezvous_fails_naming_it(tmp_path):
    """A non-master node (not the store's host) whose rendezvous never answers: torchrun's own path."""
    port = free_port()  # nothing listens there
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=unreachable",
           "--rdzv_conf=is_host=false,read_timeout=3,join_timeout=5", "--max_restarts=0", "-m", "mppo", "--help"]
    rc, out, seconds = run_group(cmd, base_env(), timeout=60)
    assert rc != 0 and seconds < 30, (rc, seconds, out[-3000:])
    assert "RendezvousConnectionError" in out
    assert re.search(rf"timed out after \d+ms while trying to connect to \(127\.0\.0\.1, {port}\)", out), out[-3000:]


def test_torchrun_master_alone_fails_within_its_join_timeout(tmp_path):
    """The master node hosts the store but the other node never joins: bounded by join_timeout."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=alone",
           "--rdzv_conf=join_timeout=4", "--max_restarts=0", "-m", "mppo", "--help"]
    rc, out, seconds = run_group(cmd, base_env(), timeout=60)
    assert rc != 0 and 4 <= seconds < 30, (rc, seconds, out[-3000:])
    assert "RendezvousTimeoutError" in out


def test_sbatch_unreachable_master_ends_the_job_in_bounded_time(tmp_path):
    """Real torchrun agents under the concurrent fake srun, the first node's address unreachable (TEST-NET-1): node 1's
    probe gives up after RDZV_TIMEOUT naming the address and port, and --kill-on-bad-exit ends node 0's agent."""
    port = free_port()
    env, logs = sbatch_env(tmp_path, port, RDZV_TIMEOUT="3")
    (tmp_path / "bin" / "scontrol").write_text(FAKE_SCONTROL.replace("127.0.0.1 localhost", "192.0.2.1 localhost"))
    # micro-batch sizes that divide at this 4-rank world: the script validates the config before it launches
    micro = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "critic.ppo_micro_batch_size_per_gpu=16",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32"]
    cmd = ["bash", str(REPO / "launch/slurm.sbatch"), "configs/demo_cpu.yaml", "trainer.total_training_steps=1",
           *micro]
    rc, out, seconds = run_group(cmd, env, timeout=90)
    node1 = (logs / "node1.log").read_text()
    assert rc == 3 and seconds < 45, (rc, seconds, out, node1)
    assert f"cannot reach the rendezvous at 192.0.2.1:{port} after 3 s" in node1
    assert f"rendezvous 192.0.2.1:{port}" in (logs / "node0.log").read_text()
