"""Opt-in tier: SGLangRolloutEngine against a REAL sglang.Engine (0.5.23) running on CPU.

Not part of CI: SGLang pins a CUDA torch, so it lives in its own environment, and its start-up takes 20-60 s.
Set MPPO_SGLANG_CPU_PYTHON to a Python that has sglang (installed with --no-deps beside CPU torch, see the
rollout report / gpu_stack_on_cpu.md) and run:
    MPPO_SGLANG_CPU_PYTHON=/path/to/python .venv/bin/pytest tests/test_rollout_sglang_cpu.py
This file writes the two stand-ins SGLang needs on CPU (an sgl_kernel whose names exist but are never called, and
the schemas of torchvision's C++ ops, whose PyPI build is CUDA-linked) into a temporary directory on PYTHONPATH.

What SGLang on CPU cannot do, so this tier does not check: release/resume_memory_occupation (torch_memory_saver is
CUDA-only) and per-sample seeds (sampling_seed needs enable_deterministic_inference, which has no CPU attention
backend); both are disabled here, the only departures from the production server arguments.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

_SGL_KERNEL_STUB = '''
"""Test stand-in for sgl_kernel (no CPU build on PyPI): every name and submodule exists; calling one raises."""
import importlib.abc, importlib.machinery, sys, types

class _Stub:
    def __init__(self, name):
        self._name = name
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(self._name + "." + attr)
    def __call__(self, *args, **kwargs):
        raise NotImplementedError("sgl_kernel stub: " + self._name + " was called")

def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub(name)

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module
    def exec_module(self, module):
        pass

sys.meta_path.insert(0, _Finder())
'''

_TORCHVISION_SCHEMAS = '''
import torch
_lib = torch.library.Library("torchvision", "DEF")
for _schema in [
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
]:
    _lib.define(_schema)
'''


def test_against_real_sglang_engine_on_cpu(tmp_path):
    import pytest

    python = os.environ.get("MPPO_SGLANG_CPU_PYTHON")
    if not python:
        pytest.skip("opt-in tier: set MPPO_SGLANG_CPU_PYTHON to a Python with sglang 0.5.23 (see module docstring)")
    stubs = tmp_path / "stubs"
    (stubs / "sgl_kernel").mkdir(parents=True)
    (stubs / "sgl_kernel" / "__init__.py").write_text(_SGL_KERNEL_STUB)
    (stubs / "sitecustomize.py").write_text(_TORCHVISION_SCHEMAS)
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(stubs), str(REPO), str(Path(__file__).parent)]),
    }
    code = f"from test_rollout_sglang_cpu import run_tier; run_tier({str(tmp_path)!r})"
    proc = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["greedy_tokens_equal_cpu_engine"], result
    assert result["greedy_log_prob_error"] < 1e-5, result
    assert result["sampled_log_prob_error"] < 1e-5, result  # temperature-scaled, full-vocabulary semantics
    assert result["stop_includes_token"] and result["stop_reason"] == "stop", result
    assert result["changed_weight_log_prob_shift"] > 1e-2, "update_weights must visibly change the model"
    assert result["changed_weight_log_prob_error"] < 1e-5, result


def run_tier(out_dir: str) -> None:
    """Runs in the SGLang environment (a subprocess of the test)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from mppo.rollout import SamplingParams, sglang_protocol
    from mppo.rollout.cpu_engine import CPURolloutEngine
    from mppo.rollout.sglang_engine import SGLangRolloutEngine

    # The two server arguments SGLang cannot honour on CPU (see the module docstring).
    sglang_protocol._FIXED_SERVER_ARGS.update(enable_deterministic_inference=False, enable_memory_saver=False)
    torch.set_num_threads(1)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, initializer_range=0.2)
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model_dir = Path(out_dir) / "model"
    source.save_pretrained(model_dir)  # SGLang reads the config from here; weights come from update_weights

    engine = SGLangRolloutEngine(str(model_dir), gpu_memory_utilization=0.3, dtype="float32", server_args={
        "device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True})
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

    result = {}
    push(source)
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
    push(source)
    changed = engine.generate(prompts, greedy, step=0)
    result["changed_weight_log_prob_shift"] = max(
        abs(a - b) for before, after in zip(got, changed) for a, b in zip(before.log_probs[:1], after.log_probs[:1]))
    result["changed_weight_log_prob_error"] = recompute_error(source, changed, 1.0)
    engine.shutdown()
    (Path(out_dir) / "result.json").write_text(json.dumps(result))
    print(json.dumps(result))
