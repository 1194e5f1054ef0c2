"""`mppo bench kernels --quick` runs end to end (one fresh worker process per implementation) and prints its
side-by-side table: naive, the fused log-prob op (recompute) and the fused PPO loss compute the same loss."""
from __future__ import annotations

import json

from mppo.bench.kernels import main


def test_quick_benchmark_runs_and_reports(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--impls", "naive,torch,ppo-torch,triton", "--device", "cpu", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| naive " in table and "| torch " in table and "| ppo-torch " in table and "GPU only" in table
    results = {r["impl"]: r for r in json.loads(out.read_text())}
    assert results["triton"] == {"impl": "triton", "n": 256, "h": 64, "skipped": "GPU only"}
    naive = results["naive"]
    for impl in ("torch", "ppo-torch"):  # same problem in every process: the same PPO loss
        assert abs(results[impl]["loss"] - naive["loss"]) <= 1e-5 * abs(naive["loss"]) + 1e-7, impl
    assert naive["extra_bytes"] > 0 and results["ppo-torch"]["time_s"] > 0
    ppo_row = next(line for line in table.splitlines() if line.startswith("| ppo-torch"))
    assert ppo_row.split("|")[8].strip().endswith("x")  # the "vs recompute" column is filled
