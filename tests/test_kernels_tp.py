"""TP=2 vocab-parallel fused log-prob/entropy and fused PPO loss equal the unsharded float64 reference (one
torchrun launch)."""
from __future__ import annotations

from pathlib import Path

from dist_util import run_torchrun

SCRIPT = Path(__file__).parent / "dist" / "kernels_tp.py"


def test_vocab_parallel_fused_logprob_matches_unsharded_reference(tmp_path):
    ranks = run_torchrun(SCRIPT, 2, tmp_path, timeout=300)
    expected = {"torch_basic", "torch_temp_chunked", "torch_padded_vocab", "torch_padded_empty_shard",
                "torch_no_entropy", "triton_padded", "naive_megatron_mappings", "ppo_torch",
                "ppo_torch_padded_empty_shard", "ppo_triton_padded"}
    for rank, results in enumerate(ranks):
        assert set(results) == expected, f"rank {rank} ran {sorted(results)}"
        for case, errors in results.items():
            assert errors["no_grad_has_graph"] == 0.0, (rank, case)
            if "entropy_is_none" in errors:
                assert errors["entropy_is_none"] == 1.0, (rank, case)
            for key in ("log_prob", "entropy", "grad_hidden", "grad_weight", "no_grad_log_prob", "loss", "stats"):
                if key in errors:
                    assert errors[key] < 1e-5, f"rank {rank} {case} {key}: relative error {errors[key]:.2e}"
