"""Host buffers without CUDA pinning for SGLang on the CPU, installed by sitecustomize in SGLang's processes.

Why it exists: pinning (page-locking) host memory needs a CUDA runtime, which CPU torch does not have, and SGLang
0.5.23 pins unconditionally in two places a CPU run reaches:
- the host side of its routed-experts capturer (enable_return_routed_experts, for routing replay) is allocated with
  `ALLOC_MEMORY_FUNCS[device]` (sglang/srt/mem_cache/pool_host/common.py); for device "cpu" that is
  `alloc_with_host_register`, which calls cudaHostRegister through `torch.cuda.cudart()`: the scheduler fails at
  start-up with "AssertionError: Torch not compiled with CUDA enabled" (state_capturer/base.py, BaseHostCache);
- its LoRA layers, adapter weights and the torch-native LoRA backend (enable_lora, lora_backend="torch_native", for
  adapter-only weight sync) build their small index/offset tensors with `pin_memory=True` and call
  `.pin_memory()` on adapter weights: "RuntimeError: pin_memory=True requires a CUDA or other accelerator backend".

What it changes: once those modules are imported, "cpu" gets an allocator that returns the same zero-copy host
tensor unregistered, and the LoRA modules see a `torch` whose factories ignore `pin_memory` and whose tensors'
`pin_memory()` returns the tensor itself. Pinning only speeds up copies to a GPU; with the model on the CPU there
are none, so nothing else changes (the same buffers, the same shapes, the same values).
"""
import importlib.abc
import importlib.util
import sys
import types

HOST_POOL = "sglang.srt.mem_cache.pool_host.common"
LORA_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.lora", "sglang.srt.lora.mem_pool",
                "sglang.srt.lora.backend.torch_backend")


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch_host_pool(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned


def _torch_without_pinning():
    """A stand-in for the `torch` module inside SGLang's LoRA modules: every attribute is torch's, except that
    the tensor factories drop `pin_memory` (and Tensor.pin_memory is made the identity, see _patch_lora)."""
    import torch

    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)

    def unpinned(factory):
        def make(*args, pin_memory=False, **kwargs):
            return factory(*args, **kwargs)
        return make

    for name in ("tensor", "empty", "zeros", "ones", "arange", "full", "empty_like", "zeros_like", "ones_like"):
        setattr(proxy, name, unpinned(getattr(torch, name)))
    return proxy


def _patch_lora(module) -> None:
    import torch

    if not torch.cuda.is_available():
        # The adapters' weights are pinned with Tensor.pin_memory() (lora.py, torch_backend.py): on a CPU-only
        # torch it raises. Only SGLang's processes on the CPU load this file (see the module docstring).
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
        module.torch = _torch_without_pinning()


PATCHES = {HOST_POOL: _patch_host_pool, **{name: _patch_lora for name in LORA_MODULES}}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of each patched module so that its patch runs right after the
    module executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            PATCHES[fullname](module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
