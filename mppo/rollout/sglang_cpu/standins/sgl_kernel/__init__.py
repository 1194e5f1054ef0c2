"""Stand-in for `sgl_kernel` (SGLang's compiled kernels), put on the path only when SGLang runs on the CPU.

Why it exists: SGLang 0.5.23 imports sgl_kernel (and names from its submodules) at start-up on every device, and
the CPU build of sgl_kernel is not on PyPI (the PyPI `sglang-kernel` wheel is CUDA-only).

Why it is inert: with attention_backend=torch_native and sampling_backend=pytorch (what mppo.rollout.sglang_cpu
passes), a dense Llama/Qwen2/Qwen3 model or a Qwen3-MoE (its fused CPU q/k-norm + rotary op needs
torch.ops.sgl_kernel.fused_qk_norm_rope_cpu, which this stand-in does not register; its experts take
moe_forward_native) at tp 1 runs on torch ops only: attention is torch's scaled_dot_product_attention,
sampling is torch.softmax/multinomial, RMSNorm/SiLU/rotary take their torch-native forward on CPU. Every name
exists so the imports succeed; calling any of them raises NotImplementedError, so a path that did need a kernel
would fail loudly rather than compute something else. SGLang's own CPU kernels (Intel AMX) stay off: it enables
them only when torch.ops.sgl_kernel has `convert_weight_packed`, an op this Python stand-in does not register. On
ARM64 hosts SGLang calls torch.ops.sgl_kernel.init_cpu_threads_env unconditionally, so this tier is x86-64 only.
tests/test_rollout_sglang_cpu.py and tests/test_trainer_sglang.py run the real engine with it.
"""
import importlib.abc
import importlib.machinery
import sys
import types


class _Stub:
    """Any attribute of a stub is a stub; calling one raises (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Stub":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {self._name} was called; SGLang took a kernel path that "
                                  "mppo's CPU tier does not support (see mppo.rollout.sglang_cpu)")


def __getattr__(name: str) -> _Stub:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Stub(name)


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import sgl_kernel.anything` gives a module whose names are stubs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
