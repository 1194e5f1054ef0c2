"""launch/torchrun.sh and launch/slurm.sbatch, run with fake `torchrun`, `srun`, `scontrol` and `python`
executables first on PATH that record their command lines (and the environment Slurm would give each node), so
a typo in a launch line fails here instead of in a user's first job. The recorded `mppo train` arguments are then
loaded with the real config loader at the launch's world size. Every script passes `bash -n`, ours `shellcheck`."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mppo.config import load_config

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "launch").glob("*.sh")) + sorted((REPO / "launch").glob("*.sbatch"))
OURS = [REPO / "launch/torchrun.sh", REPO / "launch/slurm.sbatch"]

# Each fake writes its argv one per line (plus chosen env) to $RECORD/<name>[.<node>].
FAKE_TORCHRUN = """#!/usr/bin/env bash
f="$RECORD/torchrun.${SLURM_NODEID:-local}"
printf '%s\\n' "$@" > "$f"
printf 'ENV OMP_NUM_THREADS=%s NCCL_DEBUG=%s\\n' "${OMP_NUM_THREADS:-}" "${NCCL_DEBUG:-}" >> "$f"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD/scontrol"
[[ "$1 $2" == "show hostnames" ]] || exit 1
printf '%s\\n' $FAKE_HOSTS
"""
# srun: record the options, then run the command once per node as Slurm would (SLURM_NODEID, SLURM_PROCID),
# with --output's %n replaced by the node index; exit non-zero if any node did.
FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD/srun"
output=""
while [[ "$1" == -* ]]; do
  case "$1" in --output=*) output="${1#--output=}";; esac
  shift
done
rc=0
for (( node = 0; node < SLURM_NNODES; node++ )); do
  log="${output//%n/$node}"
  SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" > "${log:-/dev/stdout}" 2>&1 || rc=$?
done
exit $rc
"""


def _fakes(tmp_path: Path, **scripts: str) -> dict[str, str]:
    bin_dir, record = tmp_path / "bin", tmp_path / "record"
    bin_dir.mkdir(parents=True)
    record.mkdir()
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "OMP_NUM_THREADS"}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "RECORD": str(record)}


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ syntax
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    proc = subprocess.run(["shellcheck", *map(str, OURS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


# ---------------------------------------------------------------------------------------------- torchrun.sh
def _torchrun_sh(tmp_path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict]:
    fake_env = _fakes(tmp_path, torchrun=FAKE_TORCHRUN,
                      python="#!/usr/bin/env bash\necho \"$FAKE_GPUS\"\n")
    proc = subprocess.run(["bash", str(REPO / "launch/torchrun.sh"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**fake_env, **env})
    return proc, fake_env


def test_torchrun_sh_single_node(tmp_path):
    proc, env = _torchrun_sh(tmp_path, "configs/demo_cpu.yaml", "trainer.seed=3", "--dry-run", NPROC="2")
    assert proc.returncode == 0, proc.stderr
    *args, env_line = _lines(Path(env["RECORD"]) / "torchrun.local")
    assert args == ["--standalone", "--nnodes=1", "--nproc_per_node=2", "-m", "mppo", "train", "configs/demo_cpu.yaml",
                    "trainer.nnodes=1", "trainer.n_gpus_per_node=2", "trainer.seed=3", "--dry-run"]
    threads = max(1, os.cpu_count() // 2) if len(os.sched_getaffinity(0)) == os.cpu_count() else None
    omp = int(env_line.split()[1].split("=")[1])
    assert omp >= 1 and (threads is None or omp == threads)
    # what torchrun would run validates at the launch's world size
    load_config(str(REPO / args[6]), [a for a in args[7:] if "=" in a], world_size=2)


def test_torchrun_sh_auto_nproc_and_errors(tmp_path):
    proc, env = _torchrun_sh(tmp_path, "configs/demo_cpu.yaml", FAKE_GPUS="4", OMP_NUM_THREADS="7")
    assert proc.returncode == 0, proc.stderr
    lines = _lines(Path(env["RECORD"]) / "torchrun.local")
    assert "--nproc_per_node=4" in lines and "trainer.n_gpus_per_node=4" in lines
    assert lines[-1].startswith("ENV OMP_NUM_THREADS=7 ")  # a user's setting is kept
    proc, _ = _torchrun_sh(tmp_path / "b", "configs/demo_cpu.yaml", FAKE_GPUS="0")
    assert proc.returncode == 2 and "no GPU visible" in proc.stderr and "NPROC" in proc.stderr
    proc, _ = _torchrun_sh(tmp_path / "c", "configs/nope.yaml", NPROC="2")
    assert proc.returncode == 2 and "config file not found: configs/nope.yaml" in proc.stderr
    proc, _ = _torchrun_sh(tmp_path / "d", NPROC="2")
    assert proc.returncode == 2 and "usage:" in proc.stderr
    proc, _ = _torchrun_sh(tmp_path / "e", "configs/demo_cpu.yaml", NPROC="two")
    assert proc.returncode == 2 and "NPROC must be a positive integer" in proc.stderr


# ---------------------------------------------------------------------------------------------- slurm.sbatch
def _sbatch(tmp_path, nodes: int, hosts: str, port: int, *args: str, **extra: str) -> tuple[subprocess.CompletedProcess,
                                                                                             Path, Path]:
    env = _fakes(tmp_path, torchrun=FAKE_TORCHRUN, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    logs = tmp_path / "logs"
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NAME="mppo", SLURM_NNODES=str(nodes), SLURM_JOB_NODELIST="gpu[1-4]",
               SLURM_GPUS_ON_NODE="8", SLURM_CPUS_ON_NODE="64", FAKE_HOSTS=hosts, MASTER_PORT=str(port),
               LOG_DIR=str(logs), PYTHON=sys.executable, **extra)
    proc = subprocess.run(["bash", str(REPO / "launch/slurm.sbatch"), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)
    return proc, Path(env["RECORD"]), logs


def test_sbatch_launches_one_torchrun_per_node(tmp_path):
    recipe = "configs/qwen2.5_32b_4node.yaml"
    with socket.socket() as master:  # stands in for node 0's rendezvous store, so the other nodes' check passes
        master.bind(("127.0.0.1", 0))
        master.listen(16)
        port = master.getsockname()[1]
        proc, record, logs = _sbatch(tmp_path, 4, "127.0.0.1 gpu2 gpu3 gpu4", port, recipe,
                                     "actor_rollout_ref.actor.optim.lr=2e-6")
    assert proc.returncode == 0, proc.stdout + proc.stderr + "".join(p.read_text() for p in logs.glob("*.log"))
    assert _lines(record / "scontrol") == ["show", "hostnames", "gpu[1-4]"]
    srun = _lines(record / "srun")
    assert srun[:4] == ["--nodes=4", "--ntasks-per-node=1", "--kill-on-bad-exit=1", f"--output={logs}/node%n.log"]
    assert srun[4:6] == ["bash", "-c"]
    expected = ["--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=4242", "--rdzv_conf=join_timeout=600", "--max_restarts=0", "-m", "mppo", "train", recipe,
                "trainer.nnodes=4", "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.optim.lr=2e-6"]
    for node in range(4):
        *args, env_line = _lines(record / f"torchrun.{node}")
        assert args == expected, node
        assert env_line == "ENV OMP_NUM_THREADS=8 NCCL_DEBUG=WARN"
        log = (logs / f"node{node}.log").read_text()
        assert f"mppo node {node}/4 on " in log and f"rendezvous 127.0.0.1:{port}" in log
    assert f"rendezvous 127.0.0.1:{port} (job 4242)" in proc.stdout
    load_config(str(REPO / recipe), expected[11:], world_size=4 * 8)  # the overrides match the 32-GPU launch


def test_sbatch_unreachable_rendezvous_fails_with_its_address(tmp_path):
    port = _free_port()  # nothing listens: the master "cannot be reached"
    # 2 nodes x 16 GPUs: the 32 GPUs the recipe's layout needs (the config is validated before the launch)
    proc, record, logs = _sbatch(tmp_path, 2, "127.0.0.1 gpu2", port, "configs/qwen2.5_32b_4node.yaml",
                                 RDZV_TIMEOUT="2", GPUS_PER_NODE="16")
    assert proc.returncode != 0
    assert (record / "torchrun.0").exists() and not (record / "torchrun.1").exists()
    log = (logs / "node1.log").read_text()
    assert f"cannot reach the rendezvous at 127.0.0.1:{port} after 2 s" in log


def test_sbatch_input_errors(tmp_path):
    proc, _, _ = _sbatch(tmp_path, 2, "127.0.0.1", 1, "configs/nope.yaml")
    assert proc.returncode == 2 and "config file not found: configs/nope.yaml" in proc.stderr
    proc, _, _ = _sbatch(tmp_path / "b", 2, "127.0.0.1", 1)
    assert proc.returncode == 2 and "usage: sbatch" in proc.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(REPO / "launch/slurm.sbatch"), "configs/qwen2.5_32b_4node.yaml"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and "not inside a Slurm allocation" in proc.stderr


# ------------------------------------------------------------------------------------ validation before launch
def _model_dir(tmp_path: Path) -> Path:
    """An HF config.json (no weights: validation and the plan read only the config): 2 KV heads, 2 layers."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}))
    return model


@pytest.mark.parametrize("layout, message", [
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3", "TP=3 does not divide the model's 2 key/value"),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3 "
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "2 layers do not split into PP x VPP = 3"),
])
def test_layouts_the_model_cannot_take_are_one_line_before_any_launch(tmp_path, layout, message):
    overrides = [f"actor_rollout_ref.model.path={_model_dir(tmp_path)}", *layout.split()]
    # mppo train --dry-run in one process: one line, exit 2, no traceback
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-m", "mppo", "train", "configs/demo_cpu.yaml", "trainer.n_gpus_per_node=3",
                           *overrides, "--dry-run"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "error" in line.lower()] == [
        next(line for line in proc.stderr.splitlines() if message in line)]
    # launch/torchrun.sh validates in one process before torchrun: the same one line, torchrun never starts
    fake_env = _fakes(tmp_path / "launch", torchrun=FAKE_TORCHRUN)
    proc = subprocess.run(["bash", str(REPO / "launch/torchrun.sh"), "configs/demo_cpu.yaml", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**fake_env, "NPROC": "3", "PYTHON": sys.executable, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (Path(fake_env["RECORD"]) / "torchrun.local").exists()
    # and so does slurm.sbatch, before srun
    proc, record, _ = _sbatch(tmp_path / "slurm", 1, "127.0.0.1", 1, "configs/demo_cpu.yaml", *overrides,
                              GPUS_PER_NODE="3")
    assert proc.returncode == 2 and message in proc.stderr, proc.stdout + proc.stderr
    assert not (record / "srun").exists()
