"""SGLangRolloutEngine against a REAL sglang.Engine (0.5.23) on the CPU: SGLang's CPU tier, installed by `make sglang`
(mppo.rollout.sglang_cpu has its stand-ins and says what works there).

Two subprocesses run at once (tests/dist/sglang_tier.py; SGLang on the CPU changes the process, which the rest of
the session must not see). The first, against a random tiny Qwen2:
- greedy tokens equal the CPU engine's, and log-probs (greedy; sampled, temperature-scaled) equal an HF recompute;
- a stop token ends a sample and is included; new weights change the log-probs and match HF again;
- a start-up failure in SGLang's scheduler process (a KV pool too small for one request) is one EngineStartError
  line in seconds after SGLang gives up, naming the cause and SGLang's log, with no SGLang process left behind;
- an idle engine uses almost no CPU (sleep_on_idle), so the co-located trainer keeps its cores;
- shutdown stops the engine's processes and no other child of the caller (SGLang's own shutdown kills them all).
The second, a tiny random Qwen3 (qwen3_tied) and Qwen3-MoE (qwen3_moe_sglang, 4 experts top-2, every layer MoE,
untied: SGLang 0.5.23's Qwen3-MoE builds every layer as MoE, ignoring mlp_only_layers, which is pinned here, and
ignores tie_word_embeddings; tests/dist/models_fixtures.py), each served by its own engine: log-probs (greedy,
sampled) equal HF's, new weights (experts and routers included) reach the engine; the Qwen3-MoE engine returns its
routed experts (return_routed_experts, for routing replay), equal to HF's router top-k on the same tokens (ties
aside) and to the CPU engine's routes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


@pytest.fixture(scope="module")
def tiers(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sglang_tier")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), str(TESTS / "dist")])}
    procs = {}
    for which in ("qwen2", "qwen3"):
        (root / which).mkdir()
        log = open(root / which / "tier.log", "w")
        procs[which] = (subprocess.Popen([sys.executable, str(TESTS / "dist" / "sglang_tier.py"), which,
                                          str(root / which)], env=env, stdout=log, stderr=subprocess.STDOUT), log)
    results = {}
    for which, (proc, log) in procs.items():
        try:
            proc.wait(timeout=900)
        finally:
            proc.kill()
            log.close()
        output = (root / which / "tier.log").read_text()
        assert proc.returncode == 0, output[-8000:]
        results[which] = json.loads((root / which / "result.json").read_text())
    results["root"] = root
    return results


def test_against_real_sglang_engine_on_cpu(tiers):
    result = tiers["qwen2"]
    assert result["greedy_tokens_equal_cpu_engine"], result
    assert result["greedy_log_prob_error"] < 1e-5, result
    assert result["sampled_log_prob_error"] < 1e-5, result  # temperature-scaled, full-vocabulary semantics
    assert result["stop_includes_token"] and result["stop_reason"] == "stop", result
    assert result["changed_weight_log_prob_shift"] > 1e-2, "update_weights must visibly change the model"
    assert result["changed_weight_log_prob_error"] < 1e-5, result
    assert result["get_weight_of_qwen2"] is None, "SGLang's Qwen2 gained get_weights_by_name: use it in the checks"

    fail = result["start_failure"]
    assert fail["error_type"] == "EngineStartError" and "\n" not in fail["message"], fail
    assert fail["message"].startswith("the SGLang engine of the test engine did not start: its scheduler process "
                                      "failed: AssertionError: max_running_request is zero"), fail
    assert str(tiers["root"] / "qwen2" / "failing.log") in fail["message"], fail
    assert fail["seconds_after_sglang_gave_up"] < 15, fail
    assert fail["children_left"] == [], fail


def test_partial_rollouts_abort_and_go_on_on_the_new_weights(tiers):
    """A weight update a third into a greedy 96-token generation aborts it (SGLang's abort_request on its event
    loop) and each response goes on from its tokens on the pushed weights: the same weights give the uninterrupted
    tokens, other weights HF's log-probs under the version that generated each token."""
    partial = tiers["qwen2"]["partial"]
    assert partial["same_weights_tokens_equal"] and partial["same_weights_interrupted"] > 0, partial
    assert partial["same_weights_log_prob_gap"] < 1e-4, partial
    assert partial["new_weights_log_prob_error"] < 5e-5, partial  # 96 tokens deep (1e-5 at 8 tokens above)
    assert partial["new_weights_lengths"] == [96] * 4 and all(0 < cut < 96 for cut in partial["new_weights_cuts"]), (
        partial["new_weights_attempts"])


def test_an_idle_engine_leaves_the_cpu_to_the_trainer(tiers):
    """sleep_on_idle (mppo's default): between rollouts SGLang's scheduler waits in a poll instead of spinning a core
    (measured without it: ~0.65 of a core per engine during the trainer's phases)."""
    assert tiers["qwen2"]["idle_cpu_fraction"] < 0.2, tiers["qwen2"]["idle_cpu_fraction"]


def test_shutdown_stops_the_engine_and_nothing_else(tiers):
    """SGLang's Engine.shutdown SIGKILLs every child of the caller; in a trainer rank that was megatron's
    dist-checkpoint Manager (the next save died with BrokenPipeError). mppo's shutdown stops the engine's own."""
    shutdown = tiers["qwen2"]["shutdown"]
    assert shutdown["engine_processes"] >= 1, shutdown
    assert shutdown["engine_processes_left"] == [], shutdown
    assert shutdown["bystander_alive"], shutdown


def test_sglang_serves_qwen3_and_qwen3_moe_with_routed_experts(tiers):
    result = tiers["qwen3"]
    for name in ("qwen3_tied", "qwen3_moe_sglang"):
        q = result[name]
        print(name, q)
        assert q["greedy_log_prob_error"] < 1e-5 and q["sampled_log_prob_error"] < 1e-5, (name, q)
        assert q["changed_weight_log_prob_shift"] > 1e-2 and q["changed_weight_log_prob_error"] < 1e-5, (name, q)
    moe = result["qwen3_moe_sglang"]
    # every token but the last of each response, both (MoE) layers, top-2
    assert moe["routes"]["shape_equal"] and moe["routes"]["rows"] > 0, moe
    assert moe["routes"]["different_not_tie"] == 0, moe
    assert moe["routes_after_change"]["shape_equal"] and moe["routes_after_change"]["different_not_tie"] == 0, moe
    assert moe["routes_equal_cpu_engine"], moe
    assert moe["sglang_ignores_mlp_only_layers"], ("SGLang's Qwen3-MoE now builds dense layers (mlp_only_layers): "
                                                   "serve such a model here and lift mppo's refusal")
