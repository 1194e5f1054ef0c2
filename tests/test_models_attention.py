"""mppo's SDPA core attention (mppo.models.attention) against a naive attention written out in the test script and
against megatron-core's DotProductAttention; the SDPA spec's GPTModel against the local spec's.

One plain-python subprocess (tests/dist/attention_cases.py, a world of one) runs every case. The comparison with HF
transformers at TP1/TP2/PP2 is in tests/test_models_parallel.py; long sequences in tests/test_long_sequences.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "dist" / "attention_cases.py"
RTOL = 1e-5  # fp32 results relative to the largest magnitude


@pytest.fixture(scope="module")
def res() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ("causal", "padding"))
def test_sdpa_and_megatron_local_equal_naive_attention(res, case):
    """Causal GQA attention without a mask (what mppo passes) and with a padding mask whose rows 0-4 of one
    sequence have no key left: outputs and the gradients of q, k, v."""
    for impl in ("sdpa", "local"):
        assert res[f"{case}/{impl}_vs_naive"] <= RTOL, impl
        assert res[f"{case}/{impl}_grads_vs_naive"] <= RTOL, impl
    assert res["causal/shape"] == [37, 2, 64]  # [s, b, heads * head_dim], as DotProductAttention returns
    assert res["padding/finite"]


def test_sdpa_mask_types_bf16_and_decode(res):
    assert res["padding_type/sdpa_vs_naive"] <= RTOL  # a padding-type layer applies no causal mask
    assert res["bf16/sdpa_vs_naive"] <= 1e-2 and res["bf16/dtype"] == "torch.bfloat16"
    assert res["decode/sdpa_vs_naive"] <= RTOL  # one query against all keys


def test_sdpa_runs_the_cpu_flash_kernel(res):
    """What SDPAttention passes (grouped K/V, fp32, causal or masked) runs torch's CPU flash kernel as it is: the
    linear memory of tests/test_long_sequences.py and `mppo bench attention` comes from it."""
    for case in ("causal", "masked"):
        assert res[f"dispatch/{case}"] == "FLASH_ATTENTION", case
        assert res[f"dispatch/{case}/kv_unchanged"], case


def test_context_parallel_query_chunk_is_lower_right_causal(res):
    """A CP rank's query chunk (natural positions 20..31) against all keys: each query sees the keys up to its own
    position. On CPU the keys before the chunk and the chunk's own keys are two flash calls merged by their
    log-sum-exps, the backward each part's flash backward: outputs and grads of q, k and v against the naive
    formula. Attention dropout there is refused in one line (the CPU flash calls take none)."""
    assert res["cp_chunk/split_vs_naive"] <= RTOL
    assert res["cp_chunk/split_grads_vs_naive"] <= RTOL
    assert res["cp_chunk/dropout"].startswith("attention dropout under context parallelism runs on CUDA only")


def test_sdpa_refuses_what_it_does_not_compute(res):
    assert res["errors/uneven_causal"].startswith("ValueError: causal SDPA attention needs as many queries")
    assert "not packed sequences; use transformer_impl=te" in res["errors/packed"]
    assert "no attention bias" in res["errors/bias"]
    assert "no sliding-window attention" in res["errors/window"]


def test_sdpa_spec_model_equals_local_spec_model(res):
    # auto picks SDPA on a machine without Transformer Engine; local keeps megatron's DotProductAttention
    assert res["model/core_attention"] == {"local": "DotProductAttention", "sdpa": "SDPAttention",
                                           "auto": "SDPAttention"}
    # no parameters in the core attention: checkpoints of either spec load into the other
    assert res["model/state_dict_keys_equal"] and res["model/sharded_keys_equal"]
    assert res["model/logits_sdpa_vs_local"] <= 1e-5
    assert res["model/grads_sdpa_vs_local_rel"] <= RTOL
