"""`mppo bench kernels --quick` runs end to end (two fresh worker processes) and prints its table."""
from __future__ import annotations

from mppo.bench.kernels import main


def test_quick_benchmark_runs_and_reports(capsys, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--impls", "naive,torch,triton", "--device", "cpu", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| naive " in table and "| torch " in table and "GPU only" in table
    import json
    results = {r["impl"]: r for r in json.loads(out.read_text())}
    assert results["triton"] == {"impl": "triton", "n": 256, "h": 64, "skipped": "GPU only"}
    naive, fused = results["naive"], results["torch"]
    # same problem in both processes: the sums of log-probs and entropies agree
    assert abs(fused["log_prob_sum"] - naive["log_prob_sum"]) < 1e-4 * abs(naive["log_prob_sum"])
    assert abs(fused["entropy_sum"] - naive["entropy_sum"]) < 1e-4 * abs(naive["entropy_sum"])
    assert naive["extra_bytes"] > 0 and fused["time_s"] > 0
