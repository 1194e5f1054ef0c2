"""Schemas of torchvision's two C++ ops that torchvision registers fake kernels for at import, for SGLang on CPU.

Why it exists: SGLang 0.5.23 imports torchvision (image transforms of its multimodal model configs) at start-up.
PyPI's torchvision is linked against the CUDA build of torch (libtorch_cuda.so, libc10_cuda.so), so beside CPU
torch its `_C` extension does not load, and `import torchvision` then fails in `_meta_registrations.py`:
`torch.library.register_fake("torchvision::nms")` raises "operator torchvision::nms does not exist". Defining the
schemas of `nms` and `qnms` first lets the pure-Python package import (its other ops register only when `_C`
loaded).

Why it is inert: a schema without a kernel cannot compute anything; calling torch.ops.torchvision.nms raises
"no kernel registered". mppo's rollout models are text-only (Llama/Qwen2/Qwen3), so SGLang never runs an image
transform, let alone non-maximum suppression.
"""
import importlib.util
from pathlib import Path

import torch


def define() -> None:
    """Define the two schemas, unless torchvision is absent, its own `_C` loads (a CPU build: it defines them), or
    they exist already (a second torch.library DEF would raise)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    try:
        torch.ops.torchvision.nms  # noqa: B018 - the lookup is the test
        return
    except (AttributeError, RuntimeError):
        pass
    extension = next(Path(spec.origin).parent.glob("_C*.so"), None)
    if extension is not None:
        try:
            torch.ops.load_library(str(extension))
            return
        except (OSError, RuntimeError):
            pass  # the CUDA-linked build: see the module docstring
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIBRARIES.append(library)  # a Library deregisters its definitions when it is garbage-collected


_LIBRARIES: list = []
