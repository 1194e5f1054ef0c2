"""`mppo bench attention --quick` runs end to end (a fresh worker process per case) and prints its table."""
from __future__ import annotations

import json

from mppo.bench.attention import main


def test_quick_attention_benchmark_runs_and_reports(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--lengths", "256", "--device", "cpu", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| sdpa " in table and "| local " in table and "mem/local" in table
    results = {r["impl"]: r for r in json.loads(out.read_text())}
    sdpa, local = results["sdpa"], results["local"]
    assert (sdpa["core_attention"], local["core_attention"]) == ("SDPAttention", "DotProductAttention")
    # the same model and input in both processes: the same loss
    assert abs(sdpa["loss"] - local["loss"]) <= 1e-4 * abs(local["loss"])
    assert sdpa["extra_bytes"] > 0 and local["extra_bytes"] > 0 and sdpa["cpu_s"] > 0
