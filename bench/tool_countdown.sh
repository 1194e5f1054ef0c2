#!/usr/bin/env bash
# Learning benchmark for multi-turn rollouts with a tool (issue 16 item 4): GRPO on countdown where
# SmolLM2-135M-Instruct may call the calculator (configs/countdown_tool_smollm2.yaml), 2 CPU ranks. Prints the
# tool-call rate (multi_turn/tool_call_rate: responses with at least one call), the calls per response and the
# training score (critic/score/mean) per step, first half vs second half.
#   1. model  `mppo convert gguf-to-hf --model smollm2-135m-instruct` (cached in ~/.cache/mppo)
#   2. data   `mppo data countdown --template tool` (the hermes calculator call shown in the user text), 2 operands
#             of 1..10 (a 135M model solves a few of those; 3 operands of 1..100 it never does)
#   3. GRPO   `torchrun --nproc_per_node 2 -m mppo train configs/countdown_tool_smollm2.yaml`
# Under RUN_DIR (default runs/tool_countdown). Knobs: PYTHON, BENCH_STEPS (default 10), BENCH_SEED; extra arguments
# are config overrides (key=value).
set -euo pipefail

RUN_DIR="${RUN_DIR:-runs/tool_countdown}"
PYTHON="${PYTHON:-python}"
STEPS="${BENCH_STEPS:-10}"
SEED="${BENCH_SEED:-0}"
mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"
export RUN_DIR
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" CUDA_VISIBLE_DEVICES="" TOKENIZERS_PARALLELISM=false

if [[ ! -f "$RUN_DIR/model/config.json" ]]; then
    say "1/3 model: mppo convert gguf-to-hf --model smollm2-135m-instruct"
    "$PYTHON" -m mppo convert gguf-to-hf --model smollm2-135m-instruct --out "$RUN_DIR/model"
fi
if [[ ! -f "$RUN_DIR/data/train.parquet" ]]; then
    say "2/3 data: mppo data countdown --template tool --num-operands 2 --max-number 10 --max-target 20"
    "$PYTHON" -m mppo data countdown --out "$RUN_DIR/data" --template tool --num-operands 2 --max-number 10 \
        --max-target 20 --train-size 80 --test-size 16 --seed "$SEED"
fi
say "3/3 GRPO with the calculator: $STEPS steps"
train_two_ranks configs/countdown_tool_smollm2.yaml trainer.total_training_steps="$STEPS" trainer.seed="$SEED" "$@"
took GRPO

"$PYTHON" - "$RUN_DIR" <<'PY'
import json
import sys
from pathlib import Path

rows = {}
for line in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines():
    if line.strip():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
keys = ("multi_turn/tool_call_rate", "multi_turn/num_tool_calls/mean", "critic/score/mean", "response_length/mean",
        "timing_s/step")
print("step  tool_call_rate  calls/response  score  response_length  step_s")
steps = sorted(s for s in rows if "critic/score/mean" in rows[s])
for s in steps:
    print(f"{s:4d}  " + "  ".join(f"{rows[s].get(k, float('nan')):.3f}" for k in keys))
half = len(steps) // 2
if half:
    for k in keys[:3]:
        first = sum(rows[s][k] for s in steps[:half]) / half
        second = sum(rows[s][k] for s in steps[half:]) / (len(steps) - half)
        print(f"{k}: first {half} steps {first:.3f} -> last {len(steps) - half} steps {second:.3f}")
PY
