"""The trainer against a REAL sglang.Engine on the CPU (SGLang 0.5.23's CPU tier, installed by `make sglang`).

One launch (2 ranks, two engines of TP 1) runs the trainers one after another on shared engines
(tests/dist/trainer_sglang.py). On a random tiny Llama (SGLang's Llama can return its weights, get_weights_by_name,
its Qwen2 cannot, and the bitwise weight check needs that): PPO (GAE + critic) for 3 steps at trainer TP2 and at
trainer DP2; GRPO with LoRA adapters at trainer TP2 (merged into the weights pushed to the engines), 2 steps; one
multi-turn GRPO step with the calculator tool at DP2 (a policy made to call it). Then the same LoRA run with
adapter-only sync (lora.merge=false) on two engines started with SGLang's LoRA support, and a random tiny Qwen3-MoE
(two new engines, which return their routed experts) trained by GRPO at EP2 with routing replay (R3), 2 steps;
SGLang's Qwen3-MoE has no get_weights_by_name either, so what reaches its engine is checked through HF
transformers loading the exporter's tensors (log-probs and routes).
"""
from __future__ import annotations

import json
import re

import pytest

from dist_util import REPO, run_torchrun
from e2e_assets import TOOL_TOKENS, dense_reward, make_assets, make_tool_policy, step_metrics, tiny_overrides

SGLANG = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
          "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=true"]
OFFLOAD = ["actor_rollout_ref.actor.megatron.param_offload=true",
           "actor_rollout_ref.actor.megatron.optimizer_offload=true"]
LORA = ["critic.enable=false", "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.actor.optim.lr=0.01", "trainer.val_before_train=false"]
MOE_R3 = ["critic.enable=false", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
          "actor_rollout_ref.actor.router_replay.mode=R3"]

# One generation phase: weights back, the push session, trainer state out, KV cache back, generate, all released
# (once flush_cache says the scheduler is idle), trainer state back (mppo.rollout.factory's docstring).
GENERATION = (r"resume_memory_occupation\(weights\) begin_weight_update (update_weights_from_tensor )+"
              r"end_weight_update flush_cache trainer_state\.offload resume_memory_occupation\(kv_cache,cuda_graph\) "
              r"(generate )+(flush_cache )+release_memory_occupation\(kv_cache,weights,cuda_graph\) "
              r"trainer_state\.reload ")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("sglang")
    assets = make_assets(root / "assets", arch="llama", tool_tokens=True)
    tool_model = make_tool_policy(assets)
    runs = root / "runs"
    common = dense_reward(assets) + SGLANG
    # the cases on one model config share its engines: the adapter-only LoRA case needs engines of its own
    cases = {
        "tp2_ppo": tiny_overrides(assets, runs / "tp2_ppo", world=2, tp=2, steps=3) + common,
        "dp2_ppo": tiny_overrides(assets, runs / "dp2_ppo", world=2, steps=3) + common + OFFLOAD,
    }
    # LoRA (merge=true): the adapters merged into the weights the engines get; a high lr so that they move
    cases["tp2_grpo_lora"] = (tiny_overrides(assets, runs / "tp2_grpo_lora", world=2, tp=2, steps=2,
                                             estimator="grpo", n=4) + common + LORA)
    # one multi-turn GRPO step on the same engines: a policy that calls the calculator (same config, own weights)
    tools = tiny_overrides(assets, runs / "dp2_grpo_tools", world=2, steps=1, estimator="grpo", n=4) + common
    cases["dp2_grpo_tools"] = [o.replace(f"{assets}/model", str(tool_model)) for o in tools] + [
        "critic.enable=false", "actor_rollout_ref.rollout.multi_turn.enable=true", "data.max_response_length=32",
        "trainer.val_before_train=false"]
    # LoRA, adapters only (merge=false): the engines hold the base and take the adapters (SGLang's LoRA support)
    cases["tp2_grpo_lora_adapters"] = (tiny_overrides(assets, runs / "tp2_grpo_lora_adapters", world=2, tp=2,
                                                      steps=2, estimator="grpo", n=4) + common + LORA
                                       + ["actor_rollout_ref.model.lora.merge=false"])
    moe = make_assets(root / "moe_assets", arch="qwen3_moe")
    cases["ep2_grpo_r3"] = (tiny_overrides(moe, runs / "ep2_grpo_r3", world=2, steps=2, estimator="grpo", n=4)
                            + dense_reward(moe) + SGLANG + MOE_R3)
    ranks = run_torchrun(REPO / "tests" / "dist" / "trainer_sglang.py", 2, root / "out",
                         ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--cases", json.dumps(cases)],
                         timeout=2400)
    for name in cases:
        ranks[0][name]["metrics"] = step_metrics(runs / name)
    ranks[0]["tool_model"] = str(tool_model)
    return ranks


def test_qwen3_moe_with_routing_replay_trains_on_sglangs_routes(launch):
    """GRPO at EP2 with R3 on SGLang: every update's batch carries the engine's routes and the engine's and the
    actor's token probabilities agree (< 1e-3, fp32; veRL's rollout_probs_diff_max as the trainer logs it). The
    case runs after the Llama engines were shut down, and its run ends with a checkpoint save."""
    for r in launch:
        case = r["ep2_grpo_r3"]
        assert case["ep"] == 2 and case["layout"] == {"tp": 1, "dp": 2}, case["layout"]
        assert len(case["rollout_probs_diff_max"]) == 2 and max(case["rollout_probs_diff_max"]) < 1e-3, case
        assert case["routes_in_batch"] == [True, True], case
    metrics = launch[0]["ep2_grpo_r3"]["metrics"]
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-3, metrics[step]
        assert metrics[step]["actor/grad_norm"] > 0


def test_qwen3_moe_sync_reaches_the_engine_and_its_routes_equal_hfs(launch):
    """After 2 trained steps, a sync from the EP2 actor (the shared exporter, experts included): the engine's
    log-probs equal HF transformers' with the exported weights, and the experts the engine reports for each token
    are HF's router top-k on the same tokens (ties aside)."""
    for r in launch:
        moe = r["ep2_grpo_r3"]["moe"]
        print(f"Qwen3-MoE on SGLang after sync: log-prob error {moe['log_prob_error']:.2e}, routes {moe['routes']}")
        assert moe["exported_expert_tensors"] == 2 * 4 * 3, moe  # 2 layers x 4 experts x gate/up/down
        assert moe["responses"] == 8 * 3 and moe["log_prob_error"] < 1e-5, moe
        assert moe["routes"]["shape_equal"] and moe["routes"]["rows"] > 0, moe
        assert moe["routes"]["different_not_tie"] == 0, moe


CASES = ("tp2_ppo", "dp2_ppo")


def test_multi_turn_grpo_step_calls_the_calculator_on_sglang(launch):
    """One multi-turn GRPO step (DP2, n=4) on the real engines with a policy that writes one calculator call
    (tests/e2e_assets.py's make_tool_policy). Every response is token for token the call, the tool turn the chat
    template renders for the calculator's real result (written here by hand), then the model's text, and only
    the tool turn is out of the loss (the engine's log-prob 0 there); the engine's log-probs of the model's tokens
    equal HF transformers' on the same weights and context (the trainer's actor agrees too); and that agreement
    would show a context without the tool turn, by far."""
    import torch
    from transformers import AutoModelForCausalLM

    from mppo.data import load_tokenizer

    tok = load_tokenizer(launch[0]["tool_model"])
    hf = AutoModelForCausalLM.from_pretrained(launch[0]["tool_model"], dtype=torch.float32).eval()
    start, body_a, body_b, end = tok.convert_tokens_to_ids(list(TOOL_TOKENS))
    bodies, worst_hf, worst_actor, worst_without_tool = set(), 0.0, 0.0, 0.0

    def log_probs(prompt: list[int], response: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]

    for r in launch:
        rows = r["dp2_grpo_tools"]["tool_rows"]
        assert len(rows) == 8 * 4 // 2, len(rows)  # this rank's half of 8 prompts x n=4
        for row in rows:
            ids, mask = row["response"], row["mask"]
            result = {body_a: "12", body_b: "7"}[ids[1]]  # calculator("3 * 4"), calculator("3 + 4")
            bodies.add(ids[1])
            tool = tok.encode(f"<|im_end|>\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)
            k = 3 + len(tool)
            assert ids[:3] == [start, ids[1], end] and ids[3:k] == tool and len(ids) > k, tok.decode(ids)
            assert mask == [1] * 3 + [0] * len(tool) + [1] * (len(ids) - k), mask
            assert row["num_tool_calls"] == 1 and row["rollout_log_probs"][3:k] == [0.0] * len(tool)
            engine = torch.tensor(row["rollout_log_probs"])
            model = torch.tensor(mask).bool()
            worst_hf = max(worst_hf, (log_probs(row["prompt"], ids) - engine)[model].abs().max().item())
            worst_actor = max(worst_actor, (torch.tensor(row["old_log_probs"]).exp() - engine.exp())[model].abs()
                              .max().item())
            without = log_probs(row["prompt"], ids[:3] + ids[k:])[3:]  # the model's text with no tool turn before
            worst_without_tool = max(worst_without_tool, (without - engine[k:]).abs().max().item())
    print(f"multi-turn on SGLang ({launch[0]['dp2_grpo_tools']['wall_s']:.0f} s of the launch): |log p| vs HF "
          f"{worst_hf:.2e}, |p| vs the actor {worst_actor:.2e}, vs HF without the tool turn {worst_without_tool:.2e}")
    assert bodies == {body_a, body_b}  # both calls were sampled: the tool's results differ, so do the rewards
    assert worst_hf < 1e-4 and worst_actor < 1e-3 and worst_without_tool > 1e-2
    m = launch[0]["dp2_grpo_tools"]["metrics"][1]
    assert m["multi_turn/tool_call_rate"] == 1.0 and m["training/rollout_probs_diff_max"] < 1e-3, m
    assert m["actor/grad_norm"] > 0, m


def test_lora_adapters_reach_the_engine_merged(launch):
    """GRPO with LoRA (rank 8, merge=true) at trainer TP2 on SGLang: the engine's token probabilities equal the
    actor's (< 1e-3) on both steps, the second one after an update of the adapters; the engine holds the merged
    weights bitwise; and the merge changed the base (so an engine left on the base weights would fail this)."""
    for r in launch:
        case = r["tp2_grpo_lora"]
        assert case["layout"] == {"tp": 2, "dp": 1}
        assert len(case["rollout_probs_diff_max"]) == 2 and max(case["rollout_probs_diff_max"]) < 1e-3, case
        assert case["weights"]["missing"] == [] and case["weights"]["different"] == [], case["weights"]
        assert case["lora_delta"] > 1e-3, case["lora_delta"]
    metrics = launch[0]["tp2_grpo_lora"]["metrics"]
    for step in (1, 2):
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-3 and metrics[step]["actor/grad_norm"] > 0


# Adapter-only sync: the first phase pushes the base, later ones only the adapters; a release keeps the base.
ADAPTER_PHASE = (r"load_lora_adapter_from_tensors flush_cache resume_memory_occupation\(kv_cache,cuda_graph\) "
                 r"(generate )+(flush_cache )+release_memory_occupation\(kv_cache,cuda_graph\) ")
ADAPTER_FIRST = r"begin_weight_update (update_weights_from_tensor )+end_weight_update flush_cache " + ADAPTER_PHASE
ADAPTER_NEXT = r"unload_lora_adapter " + ADAPTER_PHASE


def test_lora_adapters_only_reach_sglangs_lora_support(launch):
    """GRPO with LoRA (rank 8, merge=false) at trainer TP2: the engines hold the frozen base bitwise (not the merged
    weights), each sync after the first pushes only the adapters (SGLang's load_lora_adapter_from_tensors), the
    engine's token probabilities equal the actor's (< 1e-3) on both steps, and after training its log-probs equal
    HF transformers + PEFT with the actor's adapters (1e-4), far from the base's."""
    for r in launch:
        case = r["tp2_grpo_lora_adapters"]
        assert case["layout"] == {"tp": 2, "dp": 1}
        assert len(case["rollout_probs_diff_max"]) == 2 and max(case["rollout_probs_diff_max"]) < 1e-3, case
        weights = case["weights"]
        assert weights["missing"] == [] and weights["different"] == [], weights
        assert weights["equal_to_merged"] < weights["tensors"], weights  # the adapted weights are not merged
        events = " ".join(e for e in case["events"] if not e.startswith(("actor.", "trainer_state"))) + " "
        assert re.fullmatch(ADAPTER_FIRST + ADAPTER_NEXT, events), events
        adapters = case["adapters"]
        print(f"LoRA adapters only on SGLang: log-prob error vs HF + PEFT {adapters['log_prob_error_vs_peft']:.2e}, "
              f"vs the base {adapters['log_prob_error_vs_base']:.2e}; a sync moves {adapters['sync_bytes']} bytes")
        assert adapters["responses"] == 2 * 8 and adapters["log_prob_error_vs_peft"] < 1e-4, adapters
        assert adapters["log_prob_error_vs_base"] > 1e-2, adapters
        assert adapters["sync_buckets"] == 1, adapters  # one PEFT state dict, no weight bucket
    metrics = launch[0]["tp2_grpo_lora_adapters"]["metrics"]
    for step in (1, 2):
        assert metrics[step]["training/rollout_probs_diff_max"] < 1e-3 and metrics[step]["actor/grad_norm"] > 0
    # step 1 moves the base and the adapters, step 2 the adapters alone (fp32: 4 bytes x rank x (in + out) each)
    hidden, kv, ffn, layers, rank = 32, 16, 64, 2, 8  # tests/e2e_assets.py's tiny model: 4 heads of 8, 2 KV heads
    per_layer = rank * ((hidden + hidden) * 2 + (hidden + kv) * 2 + (hidden + ffn) * 3)  # q, o; k, v; gate, up, down
    assert metrics[2]["perf/weight_sync_bytes"] == launch[0]["tp2_grpo_lora_adapters"]["adapters"]["sync_bytes"] \
        == 4 * layers * per_layer < metrics[1]["perf/weight_sync_bytes"], metrics


def test_two_engines_serve_every_layout(launch):
    for rank, r in enumerate(launch):
        assert r["engines"] == 2 and r["group"] == [rank]
        assert r["tp2_ppo"]["layout"] == {"tp": 2, "dp": 1} and r["dp2_ppo"]["layout"] == {"tp": 1, "dp": 2}


def test_ppo_trains_three_steps_on_the_engines_weights(launch):
    """Every step's rollout was generated with the weights the actor had: the engine's token probabilities and the
    actor's old ones (recomputed before the update) differ by < 1e-3 (fp32) on every response token. (GRPO on the
    engines: the LoRA, multi-turn and Qwen3-MoE cases.)"""
    main = launch[0]
    for name in CASES:
        for r in launch:
            diffs = r[name]["rollout_probs_diff_max"]
            assert len(diffs) == 3 and max(diffs) < 1e-3, (name, diffs)
        metrics = main[name]["metrics"]
        assert sorted(metrics) == [0, 1, 2, 3], name
        for step in (1, 2, 3):
            m = metrics[step]
            assert m["actor/grad_norm"] > 0 and m["response_length/mean"] > 0, (name, step)
            assert "critic/vf_loss" in m, (name, step)
            # veRL's mismatch metric, as the trainer logs it
            assert m["training/rollout_probs_diff_max"] < 1e-3, (name, step)
        assert "val/test_score/countdown" in metrics[0]


def test_engine_weights_equal_the_exporters_bitwise(launch):
    for r in launch:
        for name in CASES:
            w = r[name]["weights"]
            assert w["missing"] == [] and w["different"] == [], (name, w)
            assert w["compared"] == 3 + 2 * 9, (name, w)  # embed, norm, head + 9 tensors per layer, 2 layers


def test_sglang_on_the_cpu_frees_nothing_on_release(launch):
    """Pinned limitation (mppo.rollout.sglang_cpu): without torch_memory_saver (CUDA-only) SGLang's
    release_memory_occupation keeps the weights; on a GPU they are gone until the next push."""
    for r in launch:
        assert all(r[name]["weights"]["readable_after_release"] for name in CASES)


def test_greedy_rollouts_are_the_same_at_trainer_tp2_and_dp2(launch):
    """Rollout groups do not depend on the trainer's layout: the same prompts and initial weights give the same
    greedy responses at trainer TP2 and TP1 x DP2 (every rank holds all of them)."""
    for r in launch:
        a, b = r["tp2_ppo"]["greedy"], r["dp2_ppo"]["greedy"]
        assert len(a) == 8 and [x["tokens"] for x in a] == [x["tokens"] for x in b]
        assert max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x["log_probs"], y["log_probs"])) < 1e-6
    assert launch[0]["tp2_ppo"]["greedy"] == launch[1]["tp2_ppo"]["greedy"]


def test_sglang_on_the_cpu_ignores_per_sample_seeds(launch):
    """Pinned limitation (mppo.rollout.sglang_cpu): without deterministic inference, which has no CPU attention
    backend, SGLang samples from its scheduler's RNG, so the same request with the same seed samples anew. When
    this fails, SGLang honours sampling_seed on the CPU: update the docstring and README, and compare sampled
    rollouts across layouts here."""
    for r in launch:
        first, second = r["tp2_ppo"]["sampled_twice"]
        assert [x["tokens"] for x in first] != [x["tokens"] for x in second]


def test_memory_choreography_order(launch):
    """The SGLang calls and trainer-state offloads of fit(): validation, then 3 x (generation phase, training) for
    PPO; 2 x (generation phase, actor update) for GRPO."""
    for r in launch:
        for name in CASES:
            events = " ".join(r[name]["events"]) + " "
            # the separate old-log-prob pass runs only where the update cannot reuse its own forward
            # (decisions.old_log_prob_source, tested in test_trainer_onpolicy): optional here
            train = r"(actor\.compute_log_prob )?critic\.update actor\.update "
            pattern = GENERATION + f"({GENERATION}{train}){{3}}"
            assert re.fullmatch(pattern, events), (name, events)
        # GRPO (no critic, no validation before training): the merged-LoRA case's 2 steps
        events = " ".join(r["tp2_grpo_lora"]["events"]) + " "
        assert re.fullmatch(f"({GENERATION}(actor\\.compute_log_prob )?actor\\.update ){{2}}", events), events


def test_trainer_state_offload_frees_and_restores_bitwise(launch):
    """param_offload + optimizer_offload, forced on in the DP2 PPO case (a no-op on the CPU otherwise): device
    storage of the parameter and gradient buffers is freed, parameters and optimizer state come back bitwise and the
    gradient buffers zeroed (each update zeroes them first), so training is unchanged; the 3 steps ran through
    offload/reload around each generation."""
    for r in launch:
        off = r["dp2_ppo"]["offload"]
        assert off["device_bytes_offloaded"] and all(b == 0 for b in off["device_bytes_offloaded"]), off
        assert off["optimizer_tensors"] > 0 and off["bitwise_back"] and off["grads_zero"], off


# SGLang's KV-cache check compares the free memory after loading with before: another test's process freeing memory
# meanwhile can let the tiny budget pass
@pytest.mark.serial
def test_engine_start_failure_is_one_line_and_keeps_the_checkpoint(tmp_path):
    """The first run's console has mppo's INFO lines from after SGLang started (it reconfigures the root logger).
    A resumed run whose engine cannot start (gpu_memory_utilization too small for SGLang's KV cache: its
    scheduler process fails) stops with exit code 2 and one error line naming SGLang's failure and its log, with
    no traceback; the checkpoint the first run wrote is untouched."""
    import hashlib
    import os
    import subprocess
    import sys

    assets = make_assets(tmp_path / "assets", arch="llama")
    run = tmp_path / "run"
    base = tiny_overrides(assets, run, world=1, steps=1) + dense_reward(assets) + SGLANG + [
        "trainer.val_before_train=false"]

    def train(extra: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mppo", "train", "configs/demo_cpu.yaml", *base, *extra],
                              cwd=REPO, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})

    def snapshot() -> dict[str, str]:
        return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted((run / "checkpoints").rglob("*")) if p.is_file()}

    first = train([])
    assert first.returncode == 0, first.stderr[-4000:]
    # SGLang's start reconfigures the root logger (force=True, at log_level error): mppo's INFO lines from after it,
    # the engine's own line and the last step's checkpoint, still reach the console, and SGLang logs to its file
    console = first.stderr.splitlines()
    started = [i for i, ln in enumerate(console) if "INFO rollout: 1 sglang engine(s) of TP 1" in ln]
    written = [i for i, ln in enumerate(console) if "INFO checkpoint written: " in ln]
    assert started and written and started[0] < written[-1], first.stderr[-4000:]
    assert (run / "rollout" / "sglang_group0.log").is_file()
    before = snapshot()
    assert "checkpoints/global_step_1/manifest.json" in before
    failed = train(["actor_rollout_ref.rollout.gpu_memory_utilization=0.000001"])
    assert failed.returncode == 2, failed.stderr[-4000:]
    errors = [ln for ln in failed.stderr.splitlines() if ln.startswith("mppo: error")]
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr[-4000:]
    assert ("did not start: its scheduler process failed: ValueError: Loaded weights leave no GPU memory for the KV "
            "cache") in errors[0], errors
    assert str(run / "rollout" / "sglang_group0.log") in errors[0], errors
    assert snapshot() == before
