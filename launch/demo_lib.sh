#!/usr/bin/env bash
# Shared by the demo scripts (sourced): stage messages with times, and the before -> after validation summary.
# Expects RUN_DIR (absolute) and PYTHON to be set by the script that sources it.

say() { echo "[demo $(date +%H:%M:%S)] $*"; }
DEMO_START=$SECONDS
stage_start=$SECONDS
took() { say "    $1 took $((SECONDS - stage_start)) s"; stage_start=$SECONDS; }

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
