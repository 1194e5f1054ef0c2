"""SGLang on the CPU (CI, the CPU benchmarks, `mppo doctor` without a GPU): its server arguments, what it can and
cannot do, and the import-time stand-ins it needs, activated only when SGLang runs on the CPU.

`make sglang` installs SGLang 0.5.23 with --no-deps beside the pinned CPU torch (requirements-sglang-cpu.txt), and
torchvision (which SGLang imports) into EXTRAS_DIR rather than site-packages: PyPI's torchvision is CUDA-linked, and
where transformers can see it, `from transformers import Qwen2ForCausalLM` fails on its missing ops. EXTRAS_DIR and
STANDINS_DIR reach Python only through `activate()` (this process) and `spawn_environment()` (the scheduler and
detokenizer processes sglang.Engine spawns); the stand-ins' docstrings say why each is inert.

What SGLang 0.5.23 can and cannot do on the CPU (measured on the 2-core CI machine; tests pin each point:
tests/test_rollout_sglang_cpu.py, tests/test_trainer_sglang.py):
- works: Engine(device="cpu", attention_backend="torch_native", sampling_backend="pytorch") for a dense
  Llama/Qwen2/Qwen3 and a Qwen3-MoE (its torch-native expert loop, moe_forward_native) at tp 1, start-up 20-150 s
  (2 cores, shared); return_routed_experts for routing replay (enable_return_routed_experts, with the unpinned host
  buffer of standins/mppo_unpinned_host_memory.py); generate with return_logprob (full-vocabulary,
  temperature-scaled log-probs; against an HF fp32 recompute ~1e-6); begin/end_weight_update around
  update_weights_from_tensor(load_format="flattened_bucket"); flush_cache; get_weights_by_name for Llama-family
  models (bitwise, fp32; sglang's Qwen2ForCausalLM has no get_weights_by_name and returns None); several engines
  on one host, one per trainer rank (each binds its threads to NUMA node 0: base_gpu_id is that node's index
  there); LoRA adapters pushed as tensors (enable_lora, lora_backend="torch_native", load_lora_adapter_from_tensors,
  with the unpinned buffers of standins/mppo_unpinned_host_memory.py): log-probs equal HF + PEFT ~5e-7. x86-64 only: on ARM64 SGLang calls a compiled sgl_kernel op at start-up.
- accepted, but frees nothing: release/resume_memory_occupation. torch_memory_saver (enable_memory_saver) is a
  CUDA library; with enable_memory_saver=False SGLang uses its no-op adapter, so on the CPU the engine keeps its
  weights and KV cache through training. The calls and their order are still the GPU's.
- cannot: enable_deterministic_inference. With torch_native it is rejected at start-up ("only ascend, fa3, fa4,
  flashinfer, intel_xpu, triton"), with attention_backend=triton the scheduler fails enabling batch-invariant mode
  ("No supported accelerator (CUDA/XPU) available"). Without it SGLang ignores `sampling_seed`
  (SamplingBatchInfo builds the seed tensor only under deterministic inference) and samples from the scheduler's
  torch RNG, seeded once by random_seed: the same request twice gives different tokens, so sampled rollouts depend
  on which engine generated them and on everything it generated before (not on the trainer's TP/PP/DP: the rollout
  split depends only on the rollout groups), and a resumed run does not re-sample what the uninterrupted one did.
  Greedy decoding is deterministic. A custom logit processor cannot stand in: SGLang applies it before computing
  the returned log-probs.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

STANDINS_DIR = Path(__file__).resolve().parent / "standins"
EXTRAS_DIR = Path(sys.prefix) / "mppo-sglang-cpu"  # `make sglang`: pip install --target here (torchvision)

# The server arguments of SGLang on the CPU; they replace the GPU's memory saver and deterministic inference,
# which SGLang cannot honour there (see the module docstring).
CPU_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "enable_memory_saver": False,
    "enable_deterministic_inference": False,
}


def _python_path() -> list[str]:
    return [str(STANDINS_DIR)] + ([str(EXTRAS_DIR)] if EXTRAS_DIR.is_dir() else [])


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """`env` plus what a process needs to run SGLang on the CPU (for subprocesses mppo starts itself)."""
    paths = _python_path() + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    return {**env, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": os.pathsep.join(paths)}


def activate() -> None:
    """Make this process able to import and start SGLang on the CPU (idempotent). Call it before importing sglang."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read by sglang's platform detection
    for entry in reversed(_python_path()):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    import mppo_torchvision_op_schemas  # from STANDINS_DIR; sitecustomize does this in spawned processes

    mppo_torchvision_op_schemas.define()


@contextlib.contextmanager
def spawn_environment() -> Iterator[None]:
    """While sglang.Engine starts its processes: they inherit a PYTHONPATH with the stand-ins (restored after, so
    other processes this one starts later do not run the stand-ins' sitecustomize)."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_environment(os.environ)["PYTHONPATH"]
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
