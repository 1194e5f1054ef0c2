"""`mppo bench off-policy` (mppo.bench.off_policy): its cases are valid configs of the placements they name, and
its figures are what a hand computation of the recorded generation calls and metrics gives. Not a timing test (the
bench's launches are minutes; bench/RESULTS.md section 13 has a measured run)."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mppo.bench import off_policy
from mppo.bench.step import DEFAULT_CONFIG


def _opts(**changes) -> argparse.Namespace:
    return off_policy._parser().parse_args([f"--{k.replace('_', '-')}={v}" for k, v in changes.items()])


def test_every_case_is_a_valid_config_of_its_placement(tmp_path):
    from mppo.config import load_config

    opts = _opts()
    for case, (ranks, trainer_ranks, _) in off_policy.CASES.items():
        cfg = load_config(str(DEFAULT_CONFIG), off_policy.case_overrides(opts, case, tmp_path, tmp_path / case),
                          world_size=ranks)
        assert cfg.actor_rollout_ref.hybrid_engine == (trainer_ranks == ranks), case
        assert cfg.async_training.max_off_policy_steps == {"k1": 1, "k2": 2, "k1-partial": 1}.get(case, 0), case
        assert cfg.async_training.partial_rollout == (case == "k1-partial"), case
        assert cfg.trainer.total_training_steps == opts.warmup + opts.steps + 1
        assert cfg.data.max_response_length == 64 and cfg.actor_rollout_ref.rollout.n == 4
    with pytest.raises(ValueError, match="--cases takes a comma list"):
        off_policy.run(_opts(cases="k3"))


def test_summary_is_the_hand_computation_of_the_records():
    # 4 steps: 1 warm-up, 2 measured, 1 trailing; step i's generation call carries step=i-1 (steps done)
    starts = [0.0, 10.0, 13.0, 18.0]
    calls = [{"start": t, "step": i, "prompt_tokens": 0, "lengths": [[0, 4], [0, 8], [1, 2], [1, 30]]}
             for i, t in enumerate(starts)]
    metrics = [{"step": s, "perf/total_num_tokens": 100 * s, "timing_s/step": float(s),
                "perf/weight_sync_bytes": 1000.0 * (s % 2), "perf/weight_sync_gb_per_s": 0.1 * s,
                "async/staleness/mean": 1.0 if s > 1 else 0.0, "async/gen_overlap_s": 0.5 * s} for s in (1, 2, 3, 4)]
    summary = off_policy.summarize({"calls": calls, "metrics": metrics}, warmup=1)
    # measured: steps 2 (period 13 - 10 = 3 s, 200 tokens) and 3 (18 - 13 = 5 s, 300 tokens)
    assert summary["period_s"] == pytest.approx(4.0)
    assert summary["tokens_per_s"] == pytest.approx((200 / 3 + 300 / 5) / 2)
    assert summary["tokens_per_step"] == pytest.approx(250)
    assert summary["step_s"] == pytest.approx(2.5)
    assert summary["staleness"] == 1.0 and summary["overlap_s"] == pytest.approx(1.25)
    assert summary["newer_tokens"] == 0.0  # no partial rollouts in these records
    assert summary["sync_gb_per_s"] == pytest.approx(0.2)  # steps 1 and 3 synced: median of 0.1 and 0.3
    assert summary["response_length"] == {"median": 6.0, "max": 30}
    assert summary["group_mean_length"] == {"median": 11.0, "max": 16}  # groups (4, 8) and (2, 30), twice
    table = off_policy.render({"colocated-2": summary, "k1": {**summary, "tokens_per_s": 2 * summary["tokens_per_s"]}})
    assert "throughput / colocated-2" in table
    assert table.splitlines()[-1].split()[-2:] == ["1.00x", "2.00x"]


def test_the_bench_is_listed_by_the_cli():
    from mppo.cli import _available_benchmarks

    assert "off-policy" in _available_benchmarks()
    assert Path(off_policy.__file__).name == "off_policy.py"
