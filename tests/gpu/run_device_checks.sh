#!/usr/bin/env bash
# Every GPU check in one run, for a machine with CUDA, PyTorch and Triton already installed (the project's GPU
# tier; CI has no GPU). Wheels in .whl/ (megatron-core, omegaconf, liger-kernel, ...) are installed first when the
# machine cannot reach an index. Results: $OUT/log.txt, $OUT/doctor.json, $OUT/bench_kernels.json,
# $OUT/bench_attention.json, $OUT/reports/*.json (numbers the tests measured).
#   OUT=/tmp/gpu-out bash tests/gpu/run_device_checks.sh
# STAGES picks stages (default "doctor tests bench", sized for one call of <= 9 minutes: 90 + 300 + 150 s (the
# tests stage grew a LoRA adapter-only SGLang run: with SGLang installed give it a call of its own); also
# "tune", "tune-ppo" and "attention", ~2 minutes each, and "parallel", <= 6 minutes: `mppo plan` of the scale-out
# recipes, TP2 + sequence parallelism vs HF (needs 2 GPUs: skipped, saying so, on fewer), a 32k-token log-prob pass
# on one GPU against its plan and HF; "async", <= 9 minutes: `mppo bench off-policy` on 2 GPUs, skipped, saying so,
# on fewer), GPU_TESTS the pytest targets, BENCH_IMPLS the kernels compared.
set -u
OUT="${OUT:-/tmp/mppo-gpu-checks}"
mkdir -p "$OUT/reports"
exec > >(tee "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 MPPO_TEST_ON_GPU=1 MPPO_GPU_REPORT_DIR="$OUT/reports"
PY="${PYTHON:-python3}"
stage() { echo; echo "=== $(date +%T) $*"; }

stage "install"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || echo "wheel install FAILED"
fi
# Run from the checkout (an offline editable install needs build tools from an index). mppo.kernels is shipped
# from kernels/ (setup.py package_dir), so link it in place when it does not import.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import mppo.kernels" 2>/dev/null || ln -sfn ../kernels mppo/kernels
STAGES="${STAGES:-doctor tests bench}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
"$PY" -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|megatron-core|omegaconf|liger-kernel) "

if [[ " $STAGES " == *" doctor "* ]]; then
  stage "mppo doctor"
  # with SGLang installed the doctor also starts a real engine (its round trip): minutes, not seconds
  timeout 300 "$PY" -m mppo doctor --json > "$OUT/doctor.json"; echo "doctor rc=$?"
  head -c 3000 "$OUT/doctor.json"; echo
fi

if [[ " $STAGES " == *" tests "* ]]; then
  # The SGLang trainer test in tests/gpu/test_gpu_trainer.py runs only when SGLang is installed (the device has no
  # package index); with it, give the stage a call of its own (STAGES=tests, engine start-up is 20-60 s).
  stage "GPU tests (megatron SDPA/local vs HF, actor 0.5B/1.5B at 4k, trainer GPU vs CPU and on SGLang, kernels)"
  # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu tests/test_kernels_triton.py} \
    --timeout=290 -o addopts="-ra --durations=10"
  echo "pytest rc=$?"
fi

if [[ " $STAGES " == *" tune "* ]]; then
  stage "Triton log-prob tile shapes vs Liger"
  timeout 120 "$PY" tests/gpu/tune_logprob_triton.py | tee "$OUT/tune_logprob.json"
fi

if [[ " $STAGES " == *" tune-ppo "* ]]; then
  stage "fused PPO loss (gradient in the forward): chunk sizes vs Liger, 16384 x 2048"
  timeout 150 "$PY" tests/gpu/tune_ppo_loss.py | tee "$OUT/tune_ppo_loss.json"
fi

if [[ " $STAGES " == *" bench "* ]]; then
  stage "kernel benchmark"
  timeout 150 "$PY" -m mppo bench kernels --device cuda --cases 8192x896,16384x2048 --vocab 151936 \
    --impls "${BENCH_IMPLS:-naive,triton,ppo-triton,liger,liger-grpo}" --json "$OUT/bench_kernels.json"
  echo "bench rc=$?"
fi
if [[ " $STAGES " == *" attention "* ]]; then
  stage "attention benchmark: SDPA vs local spec, 2 layers of the Qwen2.5-0.5B shape"
  timeout 120 "$PY" -m mppo bench attention --device cuda --lengths 4096,8192,16384 --layers 2 --hidden 896 \
    --heads 14 --kv-heads 2 --runs 1 --repeats 5 --json "$OUT/bench_attention.json"
  echo "bench attention rc=$?"
fi
if [[ " $STAGES " == *" parallel "* ]]; then
  stage "mppo plan of the scale-out recipes on H100 and H200 nodes (CPU only: no GPU is touched)"
  for recipe in configs/qwen3_30b_a3b_grpo.yaml configs/qwen2_5_7b_grpo_32k_cp.yaml; do
    for device in h100 h200; do
      timeout 60 "$PY" -m mppo plan "$recipe" --hf-config auto --device "$device" | grep -E "^(layout|verdict)|peak \("
      echo "plan $recipe $device rc=${PIPESTATUS[0]}"
    done
  done
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  stage "TP2 + sequence parallelism vs HF and vs TP2 without SP (2 GPUs, nccl, fp32)"
  if (( GPUS >= 2 )); then
    timeout 180 "$PY" -m torch.distributed.run --nproc_per_node 2 tests/gpu/parallel_checks.py sp "$OUT/parallel"
    echo "parallel sp rc=$?"
  else
    echo "SKIPPED: TP2 needs 2 GPUs, one per TP rank; this machine has $GPUS"
  fi
  stage "one 32k-token sequence on one GPU: the planned vs measured old-log-prob memory at CP1, log-probs vs HF"
  timeout 240 "$PY" tests/gpu/parallel_checks.py long "$OUT/parallel"
  echo "parallel long rc=$?"
  stage "mppo bench long-context on GPUs: one 32k sequence at CP1 and CP2 (NCCL), peak memory per rank"
  if (( GPUS >= 2 )); then
    timeout 240 "$PY" -m mppo bench long-context --device cuda --cps 1,2 --json "$OUT/reports/long_context.json"
    echo "bench long-context rc=$?"
  else
    echo "SKIPPED: CP2 needs 2 GPUs, one per CP rank; this machine has $GPUS"
  fi
  cp "$OUT"/parallel/parallel_*.json "$OUT/reports/" 2>/dev/null
fi
if [[ " $STAGES " == *" async "* ]]; then
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  stage "co-located vs separate k=0, k=1, k=2, k=1 partial-rollout GRPO steps on long-tail lengths (mppo bench off-policy, 2 GPUs)"
  if (( GPUS >= 2 )); then
    timeout 500 "$PY" -m mppo bench off-policy --device cuda --json "$OUT/reports/bench_off_policy.json"
    echo "bench off-policy rc=$?"
  else
    echo "SKIPPED: the separate placement gives the trainer rank and the engine rank a GPU each (cuda:LOCAL_RANK;" \
         "NCCL puts no two ranks of a group on one device), the fair co-located case the same 2; this machine has $GPUS"
  fi
fi
stage "done"
