"""Which implementation runs: `auto` picks Triton for CUDA tensors and chunked torch elsewhere; nothing falls back
silently — asking for Triton where it cannot run is an error that says what to do."""
from __future__ import annotations

import os
from types import ModuleType

import torch

BACKENDS = ("auto", "triton", "torch", "naive")


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend name ("triton", "torch" or "naive") for tensors on `device`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def require_triton(device: torch.device) -> None:
    """Raise a clear error when the Triton backend cannot run on `device`."""
    try:
        import triton  # noqa: F401  (lazy: GPU-only dependency)
    except ImportError as e:
        raise RuntimeError(
            "the Triton kernel backend needs the `triton` package: `pip install mppo[gpu]` "
            "(or choose the torch backend: backend='torch')") from e
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "Triton kernels run on CPU tensors only under the Triton interpreter: set TRITON_INTERPRET=1 before "
            "mppo.kernels first uses Triton (tests do this in conftest.py), or use backend='torch' on CPU")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"the Triton backend supports CUDA (and CPU under TRITON_INTERPRET=1), not {device.type}")


def logprob_backend(name: str, device: torch.device) -> ModuleType:
    """The module implementing a fused backend's row passes (local_stats/grad_logits_chunk for the log-prob op,
    block_stats/block_grad for the fused PPO loss)."""
    if name == "torch":
        from . import logprob_torch
        return logprob_torch
    require_triton(device)
    from . import logprob_triton
    return logprob_triton


def token_step_for(name: str, device: torch.device):
    """The fused PPO loss's per-chunk token step for a fused backend name (ppo_token_loss.token_step's contract)."""
    if name == "torch":
        from .ppo_token_loss import token_step
        return token_step
    require_triton(device)
    from .ppo_token_triton import token_step as triton_token_step
    return triton_token_step
