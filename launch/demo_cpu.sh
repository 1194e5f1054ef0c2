#!/usr/bin/env bash
# The CPU demo: from nothing, with no downloads, on 2 CPU cores, in about 5-8 minutes:
#   1. data       `mppo data countdown`: TinyZero's countdown task with two numbers (1..50), short prompts
#   2. tokenizer  `mppo data tokenizer`: a small byte-level BPE tokenizer trained on the task's texts
#   3. warm-up    `mppo sft --init-tiny`: a random tiny Qwen2 (hidden 128, 2 layers) imitates demonstrations of
#                 which 75% use random operators (--solution-noise 0.75): it learns the answer format and to use
#                 the prompt's numbers, but its sampled answers pick the right operator only part of the time
#   4. PPO        `torchrun --nproc_per_node 2 -m mppo train configs/demo_cpu.yaml`: PPO + GAE + critic, TP=2,
#                 gloo; the reward (TinyZero's countdown score) teaches which operator reaches the target
# then prints the validation score (held-out problems, sampled as in the rollout) before -> after PPO.
# Everything goes under RUN_DIR (default runs/demo). A stage whose output already exists is skipped, so running the
# script again resumes instead of redoing (PPO resumes from its latest checkpoint in RUN_DIR/checkpoints).
#
# Assumes the environment is set up (`make demo` does that, then calls this script with the venv first on PATH).
# Knobs (environment): PYTHON (default python), DEMO_SEED, DEMO_STEPS (PPO steps), DEMO_SFT_STEPS,
# DEMO_SFT_NOISE, DEMO_TRAIN_SIZE, DEMO_TEST_SIZE, DEMO_HIDDEN, DEMO_HEADS, MASTER_PORT (default: a free one).
# Extra arguments are passed to `mppo train` as config overrides (key=value).
set -euo pipefail

RUN_DIR="${RUN_DIR:-runs/demo}"
PYTHON="${PYTHON:-python}"
SEED="${DEMO_SEED:-0}"
STEPS="${DEMO_STEPS:-200}"
SFT_STEPS="${DEMO_SFT_STEPS:-1200}"
SFT_NOISE="${DEMO_SFT_NOISE:-0.75}"
TRAIN_SIZE="${DEMO_TRAIN_SIZE:-2000}"
TEST_SIZE="${DEMO_TEST_SIZE:-256}"
HIDDEN="${DEMO_HIDDEN:-128}"
HEADS="${DEMO_HEADS:-8}"

mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"  # absolute: the config reads it through ${oc.env:RUN_DIR}
export RUN_DIR
cd "$(dirname "$0")/.."  # configs/demo_cpu.yaml is relative to the repository root
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per process: 2 ranks on 2 cores
export CUDA_VISIBLE_DEVICES=""  # the CPU demo (trainer.device=cpu) runs on the CPU on a GPU machine too
export TOKENIZERS_PARALLELISM=false

# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh

say "run directory: $RUN_DIR (python: $(command -v "$PYTHON"))"

# 1. the task; train and test problems never overlap
if [[ -f "$RUN_DIR/data/test.parquet" ]]; then
    say "1/4 data: $RUN_DIR/data exists, skipping"
else
    say "1/4 data: mppo data countdown ($TRAIN_SIZE train / $TEST_SIZE test problems, 2 numbers in 1..50)"
    "$PYTHON" -m mppo data countdown --out "$RUN_DIR/data" --num-operands 2 --max-number 50 --max-target 400 \
        --template short --train-size "$TRAIN_SIZE" --test-size "$TEST_SIZE" --seed "$SEED"
    took data
fi

# 2. a local tokenizer (no download)
if [[ -f "$RUN_DIR/tokenizer/tokenizer.json" ]]; then
    say "2/4 tokenizer: $RUN_DIR/tokenizer exists, skipping"
else
    say "2/4 tokenizer: mppo data tokenizer"
    "$PYTHON" -m mppo data tokenizer --data "$RUN_DIR/data" --out "$RUN_DIR/tokenizer" --vocab-size 1000
    took tokenizer
fi

# 3. the warm-up (mppo sft writes its directory atomically: it exists only when complete)
if [[ -f "$RUN_DIR/model/config.json" ]]; then
    say "3/4 warm-up: $RUN_DIR/model exists, skipping"
else
    say "3/4 warm-up: mppo sft --init-tiny ($SFT_STEPS steps, solution noise $SFT_NOISE)"
    "$PYTHON" -m mppo sft --init-tiny --tokenizer "$RUN_DIR/tokenizer" --data "$RUN_DIR/data/train.parquet" \
        --out "$RUN_DIR/model" --hidden "$HIDDEN" --layers 2 --heads "$HEADS" --kv-heads $((HEADS / 2)) \
        --steps "$SFT_STEPS" --lr 2e-3 --batch-size 32 --solution-noise "$SFT_NOISE" --seed "$SEED" --no-progress
    took warm-up
fi

# 4. PPO under torchrun: 2 ranks, TP=2, gloo
if [[ -d "$RUN_DIR/checkpoints/global_step_$STEPS" ]]; then
    say "4/4 PPO: $STEPS steps already done, skipping"
else
    say "4/4 PPO: torchrun --nproc_per_node 2 -m mppo train configs/demo_cpu.yaml ($STEPS steps)"
    train_two_ranks configs/demo_cpu.yaml trainer.total_training_steps="$STEPS" trainer.seed="$SEED" "$@"
    took PPO
fi

print_summary
