"""`mppo bench long-context` (mppo.bench.long_context) at a small size: its CP2 launch's log-probs (old and
reference) equal the CP1 launch's and the update's grad norm matches, every rank reports every pass, and bad options
stop with one line. Not a memory test: the bench prints the ratios (bench/RESULTS.md section 14 has the 32k run)."""
from __future__ import annotations

import json
import re

import pytest

from mppo.bench import long_context

SMALL = ["--tokens", "512", "--prompt", "64", "--hidden", "32", "--intermediate", "64", "--layers", "2",
         "--heads", "4", "--kv-heads", "2", "--vocab", "256"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setattr(long_context, "CACHE", tmp_path_factory.mktemp("cache"))
    out = tmp_path_factory.mktemp("bench") / "out.json"
    assert long_context.main(SMALL + ["--cps", "1,2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_cp2_equals_cp1_and_every_rank_reports_every_pass(measured):
    cp1, cp2 = measured["cases"]
    assert (cp1["cp"], cp2["cp"]) == (1, 2) and [len(c["ranks"]) for c in measured["cases"]] == [1, 2]
    assert cp1["core_attention"] == "SDPAttention" and not cp1["skipped"] and not cp2["skipped"]
    assert len(cp1["old_log_probs"]) == len(cp2["ref_log_probs"]) == 512 - 64
    row = measured["summaries"][1]
    assert row["log_prob_diff"] <= 1e-5 and row["ref_log_prob_diff"] <= 1e-5
    assert 0 < cp1["grad_norm"] < float("inf") and row["grad_norm_rel_diff"] <= 1e-4
    for case in measured["cases"]:
        for rank in case["ranks"]:
            assert set(rank) == set(long_context.PASSES)
            assert all(rank[p]["extra_bytes"] > 0 and rank[p]["seconds"] > 0 for p in long_context.PASSES)
    summary = measured["summaries"][0]
    assert summary["step_ratio"] == 1.0 and summary["log_prob_diff"] == 0.0


def test_the_printed_table_is_the_summary(measured, capsys):
    print(long_context.render(measured["summaries"]))
    table = capsys.readouterr().out
    cp2 = measured["summaries"][1]
    assert f"{cp2['step_extra_mib']:.1f}" in table and f"{cp2['step_ratio']:.3f}" in table


@pytest.mark.parametrize("args,message", [
    (["--tokens", "1002", "--cps", "1,4"], "not divisible by 2\\*CP = 8"),
    (["--cps", "1,x"], "--cps must be a comma list of integers"),
    (["--tokens", "64", "--prompt", "64"], "--prompt must be between 1"),
])
def test_bad_options_stop_in_one_line(args, message, capsys):
    assert long_context.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mppo bench long-context: ")
    assert re.search(message, err)
