#!/usr/bin/env bash
# Learning benchmark for multi-turn rollouts with a tool (issue 16 item 4): GRPO on countdown (or, BENCH_TASK=multiply,
# 2-digit multiplication) where SmolLM2-135M-Instruct may call the calculator (configs/countdown_tool_smollm2.yaml),
# 2 CPU ranks. Prints the tool-call rate (multi_turn/tool_call_rate: responses with at least one call), the calls per
# response and the training score (critic/score/mean) per step, first half vs second half.
#   1. model   `mppo convert gguf-to-hf --model smollm2-135m-instruct` (cached in ~/.cache/mppo)
#   2. data    `mppo data countdown --template tool` (the hermes calculator call shown in the user text), 3 operands
#              of 1..10, targets <= 50 (arithmetic a 135M model mostly gets wrong on its own); with BENCH_TASK=multiply
#              `mppo data multiply --template tool --digits 2` ("What is 47 * 83?": the calculator computes the answer)
#   3. warm-up `mppo sft --tool-fraction` (mppo/sft_tool.py): the untuned model never writes a complete call, so a
#              short SFT on a mix of demonstrations gives it a low but non-zero call rate: WARMUP_TOOL_FRACTION of
#              them call the calculator (half of those first try a wrong candidate, read its result, call again;
#              tool turns out of the loss), the rest answer directly, half of those with random operators
#              (multiply: one call of a * b, its result copied into the answer; the rest answer directly)
#   4. GRPO    `torchrun --nproc_per_node 2 -m mppo train configs/countdown_tool_smollm2.yaml` from the warm-up
# Under RUN_DIR (default runs/tool_countdown); each step's generations go to $GRPO_DIR/rollouts/<step>.jsonl
# (trainer.rollout_data_dir), from which the summary tells the score of responses with and without a call.
# Knobs: PYTHON, BENCH_STEPS (default 10), BENCH_SEED, WARMUP_STEPS, WARMUP_TOOL_FRACTION, WARMUP_LR, BENCH_TOOL=0
# (the same schedule with the tool disabled: multi_turn off, so a call is plain text); extra arguments are config
# overrides (key=value).
set -euo pipefail

TASK="${BENCH_TASK:-countdown}"
RUN_DIR="${RUN_DIR:-runs/tool_$TASK}"
PYTHON="${PYTHON:-python}"
STEPS="${BENCH_STEPS:-10}"
SEED="${BENCH_SEED:-0}"
WARMUP_STEPS="${WARMUP_STEPS:-24}"
WARMUP_TOOL_FRACTION="${WARMUP_TOOL_FRACTION:-0.3}"
WARMUP_LR="${WARMUP_LR:-5e-5}"
TOOL_ARGS=()
if [[ "${BENCH_TOOL:-1}" == 0 ]]; then TOOL_ARGS=(actor_rollout_ref.rollout.multi_turn.enable=false); fi
case "$TASK" in
    countdown) TASK_ARGS=(--num-operands 3 --max-number 10 --max-target 50)
               WARMUP_ARGS=(--tool-retry-fraction 0.5 --solution-noise 0.5) ;;
    multiply)  TASK_ARGS=(--digits 2)
               WARMUP_ARGS=(--tool-retry-fraction 0 --solution-noise 0) ;;  # one call: nothing to retry
    *) echo "BENCH_TASK is countdown or multiply, not '$TASK'" >&2; exit 2 ;;
esac
mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"
export RUN_DIR
cd "$(dirname "$0")/.."
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" CUDA_VISIBLE_DEVICES="" TOKENIZERS_PARALLELISM=false

if [[ ! -f "$RUN_DIR/model/config.json" ]]; then
    say "1/4 model: mppo convert gguf-to-hf --model smollm2-135m-instruct"
    "$PYTHON" -m mppo convert gguf-to-hf --model smollm2-135m-instruct --out "$RUN_DIR/model"
fi
if [[ ! -f "$RUN_DIR/data/train.parquet" ]]; then
    say "2/4 data: mppo data $TASK --template tool ${TASK_ARGS[*]}"
    "$PYTHON" -m mppo data "$TASK" --out "$RUN_DIR/data" --template tool "${TASK_ARGS[@]}" --train-size 400 \
        --test-size 32 --seed 0
fi
if [[ ! -f "$RUN_DIR/warmup/config.json" ]]; then
    say "3/4 warm-up: mppo sft --tool-fraction $WARMUP_TOOL_FRACTION, $WARMUP_STEPS steps"
    "$PYTHON" -m mppo sft --model "$RUN_DIR/model" --data "$RUN_DIR/data/train.parquet" --out "$RUN_DIR/warmup" \
        --tool-fraction "$WARMUP_TOOL_FRACTION" "${WARMUP_ARGS[@]}" \
        --steps "$WARMUP_STEPS" --batch-size 4 --lr "$WARMUP_LR" --warmup-steps 5 --max-prompt-length 192 \
        --max-response-length 192 --seed 0 --no-progress
    took warm-up
fi
# GRPO writes its metrics and checkpoint under $GRPO_DIR (one per seed / tool setting), the warm-up is shared
GRPO_DIR="$RUN_DIR/grpo_seed${SEED}_tool${BENCH_TOOL:-1}"
say "4/4 GRPO from the warm-up (tool ${BENCH_TOOL:-1}): $STEPS steps -> $GRPO_DIR"
train_two_ranks configs/countdown_tool_smollm2.yaml trainer.total_training_steps="$STEPS" trainer.seed="$SEED" \
    trainer.default_local_dir="$GRPO_DIR" trainer.rollout_data_dir="$GRPO_DIR/rollouts" ${TOOL_ARGS[@]+"${TOOL_ARGS[@]}"} "$@"
took GRPO

"$PYTHON" - "$GRPO_DIR" <<'PY'
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
# from the step's generations (trainer.rollout_data_dir): does a call pay? mean score with and without one
dumps = Path(sys.argv[1]) / "rollouts"
if dumps.is_dir():
    print("step  score_with_call (n)  score_without_call (n)")
    for s in steps:
        path = dumps / f"{s}.jsonl"
        if not path.is_file():
            continue
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        # the agent loop's count of parsed calls; with the tool off (BENCH_TOOL=0) a call is only text
        made_call = [x["num_tool_calls"] > 0 if "num_tool_calls" in x else "<tool_call>" in x["output"] for x in lines]
        called = [x["score"] for x, c in zip(lines, made_call) if c]
        direct = [x["score"] for x, c in zip(lines, made_call) if not c]
        mean = lambda v: sum(v) / len(v) if v else float("nan")
        print(f"{s:4d}  {mean(called):.3f} ({len(called)})  {mean(direct):.3f} ({len(direct)})")
half = len(steps) // 2
if half:
    for k in (k for k in keys[:3] if all(k in rows[s] for s in steps)):  # no tool metrics with the tool off
        first = sum(rows[s][k] for s in steps[:half]) / half
        second = sum(rows[s][k] for s in steps[half:]) / (len(steps) - half)
        print(f"{k}: first {half} steps {first:.3f} -> last {len(steps) - half} steps {second:.3f}")
PY
