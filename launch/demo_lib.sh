#!/usr/bin/env bash
# Shared by the demo scripts (sourced): stage messages with times, and the before -> after validation summary.
# Expects RUN_DIR (absolute) and PYTHON to be set by the script that sources it.

say() { echo "[demo $(date +%H:%M:%S)] $*"; }
DEMO_START=$SECONDS
stage_start=$SECONDS
took() { say "    $1 took $((SECONDS - stage_start)) s"; stage_start=$SECONDS; }

# `mppo train CONFIG [key=value ...]` on 2 local ranks under torchrun, the config validated in one process first:
# a mistake in an override is then one line instead of a line buried in torchrun's report of each failed rank.
train_two_ranks() {
    local config=$1
    shift
    WORLD_SIZE=2 RANK=0 "$PYTHON" -m mppo train "$config" "$@" --dry-run >/dev/null
    local rendezvous=(--standalone)  # a local rendezvous on a free port
    if [[ -n "${MASTER_PORT:-}" ]]; then rendezvous=(--master_addr 127.0.0.1 --master_port "$MASTER_PORT"); fi
    "$PYTHON" -m torch.distributed.run --nproc_per_node 2 "${rendezvous[@]}" -m mppo train "$config" "$@"
}

# The validation score of the first and the last validated step, per data source, from metrics.jsonl.
print_summary() {
    "$PYTHON" - "$RUN_DIR" <<'EOF'
import json
import sys
from pathlib import Path

run = Path(sys.argv[1])
steps: dict[int, dict] = {}
for line in (run / "metrics.jsonl").read_text().splitlines():
    if line.strip():
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
scores = {s: {k: v for k, v in row.items() if k.startswith("val/test_score/")} for s, row in sorted(steps.items())}
scores = {s: v for s, v in scores.items() if v}
print(f"[demo] metrics: {run / 'metrics.jsonl'}")
print(f"[demo] plot:    {run / 'metrics.png'}")
if scores:
    first, last = min(scores), max(scores)
    for key, before in scores[first].items():
        after = scores[last].get(key, float("nan"))
        print(f"[demo] {key}: {before:.3f} (step {first}) -> {after:.3f} (step {last}), {after - before:+.3f}")
EOF
    say "total $((SECONDS - DEMO_START)) s"
}
