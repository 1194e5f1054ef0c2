"""Megatron-core actor on one GPU (nccl, local spec) vs HF transformers on the same GPU, fp32 and bf16, through
mppo's pipeline schedule, with torch and Triton log-prob kernels; and a bf16 update-throughput figure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpu_report import report

REPO = Path(__file__).resolve().parents[2]


def test_megatron_matches_hf_on_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "megatron_vs_hf.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    report("megatron_vs_hf", res)
    assert "parity_cases/error" not in res, res["parity_cases/error"]
    assert res["dims"] == ["nccl", "cuda:0"]
    for name in ("qwen2_untied", "llama_tied"):
        assert res[f"{name}/float32/param_device"] == "cuda:0"
        for key in ("logits", "log_probs", "entropy", "triton_log_probs", "triton_entropy"):
            assert res[f"{name}/float32/{key}"] < 1e-3, (name, key, res[f"{name}/float32/{key}"])
            assert res[f"{name}/bfloat16/{key}"] < 0.15, (name, key, res[f"{name}/bfloat16/{key}"])
        assert res[f"{name}/float32/export_bitwise"] is True
        assert res[f"{name}/float32/final_norm_grad"] < 1e-3
    assert "update_throughput/error" not in res, res["update_throughput/error"]
    assert 0 < res["update"]["mfu"] < 1
