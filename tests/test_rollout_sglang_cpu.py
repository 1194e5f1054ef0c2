"""SGLangRolloutEngine against a REAL sglang.Engine (0.5.23) on the CPU: SGLang's CPU tier, installed by `make sglang`
(mppo.rollout.sglang_cpu has its stand-ins and says what works there).

It runs in a subprocess: SGLang on the CPU changes the process (SGLANG_USE_CPU_ENGINE, the stand-ins on sys.path),
which the rest of the test session must not see. One subprocess checks, against a random tiny Qwen2:
- greedy tokens equal the CPU engine's, and log-probs (greedy; sampled, temperature-scaled) equal an HF recompute;
- a stop token ends a sample and is included; new weights change the log-probs and match HF again;
- a start-up failure in SGLang's scheduler process (a KV pool too small for one request) is one EngineStartError
  line in seconds after SGLang gives up, naming the cause and SGLang's log, with no SGLang process left behind.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def test_against_real_sglang_engine_on_cpu(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(Path(__file__).parent)])}
    code = f"from test_rollout_sglang_cpu import run_tier; run_tier({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads((tmp_path / "result.json").read_text())
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
    assert str(tmp_path / "failing.log") in fail["message"], fail
    assert fail["seconds_after_sglang_gave_up"] < 15, fail
    assert fail["children_left"] == [], fail


def run_tier(out_dir: str) -> None:
    """Runs in a subprocess of the test."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mppo.rollout import SamplingParams
    from mppo.rollout.cpu_engine import CPURolloutEngine
    from mppo.rollout.sglang_engine import SGLangRolloutEngine

    torch.set_num_threads(1)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, initializer_range=0.2)
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model_dir = Path(out_dir) / "model"
    source.save_pretrained(model_dir)  # SGLang reads the config from here; weights come from update_weights

    result = {"start_failure": start_failure(model_dir, Path(out_dir) / "failing.log")}
    engine = SGLangRolloutEngine(str(model_dir), gpu_memory_utilization=0.3, dtype="float32", on_cpu=True,
                                 max_total_tokens=4096, log_path=Path(out_dir) / "sglang.log")
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]

    def push(model):
        state = list(model.state_dict().items())
        engine.update_weights([state[i : i + 4] for i in range(0, len(state), 4)])

    def recompute_error(model, responses, temperature):
        worst = 0.0
        for r in responses:
            ids = torch.tensor([prompts[r.prompt_index] + r.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompts[r.prompt_index]) - 1 : -1].float()
            ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(r.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(r.log_probs)).abs().max().item())
        return worst

    push(source)
    result["get_weight_of_qwen2"] = engine.get_weight("model.norm.weight")
    greedy = SamplingParams(do_sample=False, max_new_tokens=8)
    got = engine.generate(prompts, greedy, step=0)
    cpu_engine = CPURolloutEngine(config)
    cpu_engine.update_weights(source.state_dict().items())
    result["greedy_tokens_equal_cpu_engine"] = [r.token_ids for r in got] == [
        r.token_ids for r in cpu_engine.generate(prompts, greedy, step=0)]
    result["greedy_log_prob_error"] = recompute_error(source, got, 1.0)

    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, top_k=50, max_new_tokens=8), step=0)
    result["sampled_log_prob_error"] = recompute_error(source, sampled, 0.8)

    stop_token = got[0].token_ids[2]
    stopped = engine.generate(prompts[:1], SamplingParams(do_sample=False, max_new_tokens=8,
                                                          stop_token_ids=[stop_token]), step=0)[0]
    first = got[0].token_ids.index(stop_token)
    result["stop_includes_token"] = stopped.token_ids == got[0].token_ids[: first + 1]
    result["stop_reason"] = stopped.finish_reason

    with torch.no_grad():
        source.model.norm.weight.mul_(3.0)
    engine.release()  # the trainer's sequence: release, push (resumes the weights), resume the KV cache
    push(source)
    engine.resume()
    changed = engine.generate(prompts, greedy, step=0)
    result["changed_weight_log_prob_shift"] = max(
        abs(a - b) for before, after in zip(got, changed) for a, b in zip(before.log_probs[:1], after.log_probs[:1]))
    result["changed_weight_log_prob_error"] = recompute_error(source, changed, 1.0)
    engine.shutdown()
    (Path(out_dir) / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))


def start_failure(model_dir: Path, log_path: Path) -> dict:
    """Start an engine whose scheduler must fail (a KV pool of one token holds no request)."""
    import time

    import psutil

    from mppo.rollout.sglang_engine import SGLangRolloutEngine
    from mppo.rollout.sglang_startup import EngineStartError

    try:
        SGLangRolloutEngine(str(model_dir), gpu_memory_utilization=0.3, dtype="float32", on_cpu=True,
                            max_total_tokens=1, log_path=log_path, name="the test engine")
        out = {"error_type": None, "message": "started"}
    except EngineStartError as err:
        raised = time.time()
        out = {"error_type": type(err).__name__, "message": str(err)}
        # when SGLang's scheduler logged its failure (the log file's last write) to when the error was raised
        out["seconds_after_sglang_gave_up"] = raised - log_path.stat().st_mtime
    out["children_left"] = [p.pid for p in psutil.Process().children(recursive=True)]
    return out
