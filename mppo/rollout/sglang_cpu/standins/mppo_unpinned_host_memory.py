"""Host buffers without CUDA pinning for SGLang on the CPU, installed by sitecustomize in SGLang's processes.

Why it exists: SGLang 0.5.23 allocates the host side of its routed-experts capturer (enable_return_routed_experts,
for routing replay) with `ALLOC_MEMORY_FUNCS[device]` (sglang/srt/mem_cache/pool_host/common.py); for device "cpu"
that is the default, `alloc_with_host_register`, which page-locks the buffer with cudaHostRegister through
`torch.cuda.cudart()`. CPU torch has no CUDA runtime, so the scheduler process fails at start-up with
"AssertionError: Torch not compiled with CUDA enabled" (state_capturer/base.py, BaseHostCache).

What it changes: once that module is imported, "cpu" gets an allocator that returns the same zero-copy host tensor
unregistered. Pinning only speeds up copies from a GPU; with the model on the CPU there are none, so nothing else
changes (the same buffers, the same shapes, the same reads and writes).
"""
import importlib.abc
import importlib.util
import sys

TARGET = "sglang.srt.mem_cache.pool_host.common"


def _alloc_unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_unpinned


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of TARGET so that _patch runs right after it executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
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
            _patch(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
