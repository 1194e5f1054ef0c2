"""Prompt + response of 2k, 4k and 8k tokens through the actor's log-prob pass and PPO update (SDPA attention spec,
fused log-prob kernel, fp32, a tiny Qwen2 with 8,192 positions): log-probs equal to HF transformers', and memory
that grows linearly with the length.

Each length runs in a fresh process (tests/dist/long_sequence.py), which reports the peak memory of each pass
beyond what the process held before it. megatron's local spec runs once at 2k as the contrast: its
DotProductAttention keeps [heads, s, s] scores, which this measurement must see.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "dist" / "long_sequence.py"
HEADS, MAX_POSITIONS = 4, 8192
pytestmark = pytest.mark.serial  # peak resident set sizes: measured with no other test running
LENGTHS = {2048: (512, 1536), 4096: (1024, 3072), 8192: (2048, 6144)}  # total: (prompt, response)


def _make_model(path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=HEADS,
                         num_key_value_heads=2, vocab_size=512, max_position_embeddings=MAX_POSITIONS,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)


def _run(model: Path, prompt: int, response: int, impl: str, hf_check: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(SCRIPT), "--hf", str(model), "--prompt", str(prompt), "--response", str(response),
           "--impl", impl] + (["--hf-check"] if hf_check else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    model = tmp_path_factory.mktemp("long") / "model"
    _make_model(model)
    out = {("sdpa", total): _run(model, p, r, "sdpa", hf_check=True) for total, (p, r) in LENGTHS.items()}
    out["local", 2048] = _run(model, *LENGTHS[2048], "local", hf_check=False)
    return out


@pytest.mark.parametrize("total", LENGTHS)
def test_long_sequence_log_probs_match_hf_and_update_applies(runs, total):
    r = runs["sdpa", total]
    assert r["tokens"] == total and r["core_attention"] == "SDPAttention"
    assert r["log_probs_finite"] and r["log_probs_vs_hf"] <= 1e-4
    assert not r["skipped"] and 0 < r["grad_norm"] < float("inf")


@pytest.mark.parametrize("phase", ("log_prob", "update"))
def test_memory_grows_linearly_with_length(runs, phase):
    extra = {total: runs["sdpa", total][f"{phase}_extra_bytes"] for total in LENGTHS}
    # doubling the length at most ~doubles the memory (attention that kept [s, s] scores would quadruple it)
    assert extra[4096] <= 2.6 * extra[2048], extra
    assert extra[8192] <= 2.6 * extra[4096], extra
    # at 8k the whole pass needs less than ONE layer's [heads, s, s] fp32 score matrix (1 GiB here)
    assert extra[8192] < HEADS * 8192 ** 2 * 4, extra


def test_local_spec_reference_shows_the_quadratic_scores(runs):
    """The measurement sees [s, s] scores: megatron's local spec holds, beyond SDPA, at least one fp32
    [heads, s, s] matrix per layer for the backward (64 MiB a layer at 2k). The excess is compared, not a ratio:
    the resident set each process starts from differs by machine and allocator (SDPA at 2k: 31 MB here, 127 MB
    on CI), the excess does not."""
    local, sdpa = runs["local", 2048], runs["sdpa", 2048]
    assert local["core_attention"] == "DotProductAttention"
    layers, scores = 2, HEADS * 2048 ** 2 * 4
    assert local["update_extra_bytes"] - sdpa["update_extra_bytes"] > layers * scores, (local, sdpa)
    assert local["grad_norm"] == pytest.approx(sdpa["grad_norm"], rel=1e-4)
