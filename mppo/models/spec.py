"""Which transformer layer implementation to build: Transformer Engine (GPU) or megatron-core's local one.

`transformer_impl`: "auto" picks TE when CUDA is present and `transformer_engine` imports, local otherwise;
"te" and "local" force one. TE has no CPU path, so "te" without CUDA or without the package is an error.
"""
from __future__ import annotations

from typing import Literal

import torch

from mppo.errors import UserError

TransformerImpl = Literal["auto", "te", "local"]


class MissingGpuPackageError(UserError, ImportError):
    """A GPU-only package was asked for but is not importable here."""


def _transformer_engine_imports() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError for missing CUDA/cuDNN libraries
        return False
    return True


def transformer_engine_available() -> bool:
    """True when CUDA is present and Transformer Engine's torch extension imports."""
    return torch.cuda.is_available() and _transformer_engine_imports()


def resolve_transformer_impl(transformer_impl: TransformerImpl) -> Literal["te", "local"]:
    """"te" or "local" for a `transformer_impl` setting; raises MissingGpuPackageError when "te" cannot run."""
    if transformer_impl == "local":
        return "local"
    if transformer_impl == "auto":
        return "te" if transformer_engine_available() else "local"
    if transformer_impl == "te":
        if not _transformer_engine_imports():
            raise MissingGpuPackageError(
                "transformer_impl='te' needs Transformer Engine, which does not import here: "
                "pip install mppo[gpu] on a CUDA machine (or use transformer_impl='local')")
        if not torch.cuda.is_available():
            raise MissingGpuPackageError(
                "transformer_impl='te' needs a CUDA GPU (Transformer Engine has no CPU path); "
                "use transformer_impl='local' or 'auto' on CPU")
        return "te"
    raise ValueError(f"transformer_impl must be 'auto', 'te' or 'local', got {transformer_impl!r}")


def gpt_layer_spec(transformer_impl: TransformerImpl = "auto"):
    """megatron's GPT layer ModuleSpec for a dense RMSNorm/SwiGLU decoder layer."""
    from megatron.core.models.gpt import gpt_layer_specs

    if resolve_transformer_impl(transformer_impl) == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
