"""SGLangRolloutEngine against a REAL sglang.Engine (0.5.23) on the CPU: SGLang's CPU tier, installed by `make sglang`
(mppo.rollout.sglang_cpu has its stand-ins and says what works there).

The checks run inside the one SGLang launch of the suite (tests/sglang_launch.py: a torchrun launch of
tests/dist/trainer_sglang.py, shared with tests/test_trainer_sglang.py; SGLang on the CPU changes the process,
SGLANG_USE_CPU_ENGINE and the stand-ins on sys.path, which the test session must not see). Its rank 0, against a
random tiny Qwen2 (tests/dist/sglang_tier.py):
- greedy tokens equal the CPU engine's, and log-probs (greedy; sampled, temperature-scaled) equal an HF recompute;
- a stop token ends a sample and is included; new weights change the log-probs and match HF again;
- a start-up failure in SGLang's scheduler process (a KV pool too small for one request) is one EngineStartError
  line in seconds after SGLang gives up, naming the cause and SGLang's log, with no SGLang process left behind.
Its rank 1, meanwhile, a tiny random Qwen3 (qwen3_tied) and Qwen3-MoE (qwen3_moe_sglang, 4 experts top-2, every
layer MoE, untied: SGLang 0.5.23's Qwen3-MoE builds every layer as MoE, ignoring mlp_only_layers, which is pinned
here, and ignores tie_word_embeddings; tests/dist/models_fixtures.py), each served by its own engine: log-probs (greedy, sampled) equal HF's, new weights
(experts and routers included) reach the engine; the Qwen3-MoE engine returns its routed experts
(return_routed_experts, for routing replay), equal to HF's router top-k on the same tokens (ties aside) and to the
CPU engine's routes.
"""
from __future__ import annotations


def test_against_real_sglang_engine_on_cpu(sglang_launch):
    result = sglang_launch["ranks"][0]["tier"]
    tier_dir = sglang_launch["tier_dir"]
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
    assert str(tier_dir / "qwen2" / "failing.log") in fail["message"], fail
    assert fail["seconds_after_sglang_gave_up"] < 15, fail
    assert fail["children_left"] == [], fail


def test_sglang_serves_qwen3_and_qwen3_moe_with_routed_experts(sglang_launch):
    result = sglang_launch["ranks"][1]["tier"]
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
