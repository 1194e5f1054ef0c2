#!/usr/bin/env bash
# One node: `torchrun --standalone` with one rank per GPU running `mppo train CONFIG [key=value ...]`.
# trainer.nnodes=1 and trainer.n_gpus_per_node=<ranks> are passed to match the launch.
#
#   launch/torchrun.sh configs/gsm8k_qwen2.5_7b_grpo.yaml [key=value ...] [--dry-run]
#   NPROC=2 launch/torchrun.sh configs/demo_cpu.yaml          # CPU: 2 processes (gloo)
#
# NPROC     ranks on this node; "auto" (default) = the GPUs torch sees (honours CUDA_VISIBLE_DEVICES)
# PYTHON    the interpreter with mppo: it counts the GPUs and validates the config first (default: python)
# OMP_NUM_THREADS   kept if set; otherwise the node's cores divided by the ranks (at least 1)
set -euo pipefail

usage="usage: [NPROC=N] $0 CONFIG.yaml [key=value ...] [--dry-run]"
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "$usage" >&2
  exit 2
fi
config=$1
shift
if [[ ! -f "$config" ]]; then
  echo "launch/torchrun.sh: config file not found: $config" >&2
  exit 2
fi

ranks=${NPROC:-auto}
if [[ "$ranks" == auto ]]; then
  ranks=$("${PYTHON:-python}" -c 'import torch; print(torch.cuda.device_count())')
  if [[ "$ranks" -lt 1 ]]; then
    echo "launch/torchrun.sh: no GPU visible to torch; set NPROC=<ranks> to run that many CPU processes" >&2
    exit 2
  fi
fi
if ! [[ "$ranks" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch/torchrun.sh: NPROC must be a positive integer or 'auto', got '$ranks'" >&2
  exit 2
fi

# megatron-core's tensor-parallel layers overlap their all-reduce with compute only with one CUDA connection.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
# torchrun would force 1 thread per rank; share the node's cores instead (data loading, CPU runs).
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  threads=$(( $(nproc) / ranks ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

# Validate the config once, in one process, at this launch's world size: a mistake is then one line on stderr
# instead of a line buried in torchrun's report of every failed rank.
WORLD_SIZE=$ranks RANK=0 "${PYTHON:-python}" -m mppo train "$config" trainer.nnodes=1 trainer.n_gpus_per_node="$ranks" \
  "$@" --dry-run >/dev/null

exec torchrun --standalone --nnodes=1 --nproc_per_node="$ranks" \
  -m mppo train "$config" trainer.nnodes=1 trainer.n_gpus_per_node="$ranks" "$@"
