"""Run megatron-core 0.16.1 on a machine without CUDA (gloo, CPU tensors).

megatron-core assumes CUDA in a few dozen places. Every one of them falls into one of the patches below; each
patch lists the call sites it serves. `install()` applies them all, and only when `torch.cuda.is_available()` is
False: on a GPU machine nothing here runs. `mppo.parallel.init_distributed` calls it.

A megatron-core upgrade may make a patch unnecessary. `PATCHES` names them so that a test can take each one out
(`without(name)`), run the code it serves and expect that code to fail: a patch that is no longer needed shows up
as a failing test, not as dead code.

Nothing here changes results: CUDA is absent, so every patched call would otherwise raise. The one patch that
changes an answer (`tensor_type_names`) does so only for calls made from megatron's optimizer modules.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

Undo = Callable[[], None]


@dataclass(frozen=True)
class CpuPatch:
    """One compatibility patch: `apply()` installs it and returns the function that removes it."""

    name: str
    call_sites: tuple[str, ...]
    apply: Callable[[], Undo]


def _is_cuda_device(device: Any) -> bool:
    # Without CUDA an int device can only mean a CUDA index (megatron passes torch.cuda.current_device()).
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaDeviceToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU and makes `Tensor.cuda()` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaTypeNameMode(TorchFunctionMode):
    """`tensor.type()` answers 'torch.cuda.FloatTensor' (etc.) for CPU tensors, for megatron's optimizer only."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            if _calling_module().startswith("megatron.core.optimizer"):
                return _CUDA_TYPE_NAMES.get(result, result)
        return result


def _calling_module() -> str:
    """Module of the nearest caller outside this file and torch (other modes may sit between us and it)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and not module.startswith("torch."):
            return module
        frame = frame.f_back
    return ""


def _push_mode(mode_cls: type[TorchFunctionMode]) -> Callable[[], Undo]:
    def apply() -> Undo:
        mode = mode_cls()
        mode.__enter__()
        return lambda: mode.__exit__(None, None, None)

    return apply


def _set_attr(obj: Any, name: str, value: Any) -> Undo:
    old = getattr(obj, name)
    setattr(obj, name, value)
    return lambda: setattr(obj, name, old)


def _apply_current_device() -> Undo:
    return _set_attr(torch.cuda, "current_device", lambda: 0)


def _apply_synchronize() -> Undo:
    return _set_attr(torch.cuda, "synchronize", lambda device=None: None)


_cpu_tracker: Any = None  # one CPU tracker per process, kept across apply/undo (see _apply_cpu_rng_tracker)


def _make_cpu_tracker() -> Any:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """megatron's RNG tracker over CPU generator states (same names, seeds and fork semantics).

        On CPU, dropout draws from the default CPU generator, so that generator plays the role of the CUDA one.
        """

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker()


def _apply_cpu_rng_tracker() -> Undo:
    from megatron.core.tensor_parallel import random as mrandom

    global _cpu_tracker
    if _cpu_tracker is None:
        _cpu_tracker = _make_cpu_tracker()
    # megatron's initialize_rng_tracker() and get_all_rng_states() look the class up by this module name.
    undo_class = _set_attr(mrandom, "CudaRNGStatesTracker", type(_cpu_tracker))
    # Replace whatever tracker exists (a CUDA one cannot have been seeded here) by the CPU tracker, the same
    # object every time so that taking the patch off and on again (tests) keeps its seeded states.
    undo_tracker = _set_attr(mrandom, "_CUDA_RNG_STATE_TRACKER", _cpu_tracker)
    undo_flag = _set_attr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)

    def undo() -> None:
        undo_flag()
        undo_tracker()
        undo_class()

    return undo


PATCHES: tuple[CpuPatch, ...] = (
    CpuPatch(
        "cuda_device_to_cpu",
        (
            "models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding.get_emb: inv_freq.to(current_device())",
            "transformer/utils.py get_default_causal_mask: torch.ones(..., device='cuda')",
            "pipeline_parallel/schedules.py: total_num_tokens = torch.zeros(..., device='cuda')",
            "pipeline_parallel/p2p_communication.py: recv buffers and shape tensors on current_device()",
            "distributed/param_and_grad_buffer.py: grad/param buffers on current_device(), device='cuda'",
            "optimizer/optimizer.py, optimizer/clip_grads.py: found_inf, norms, dummy buffers on 'cuda'",
        ),
        _push_mode(_CudaDeviceToCpuMode),
    ),
    CpuPatch(
        "cuda_current_device",
        (
            "models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding.get_emb",
            "pipeline_parallel/p2p_communication.py P2PCommunicator._communicate/_communicate_shapes",
            "distributed/param_and_grad_buffer.py _ParamAndGradBuffer.__init__",
        ),
        _apply_current_device,
    ),
    CpuPatch(
        "cuda_synchronize",
        ("pipeline_parallel/p2p_communication.py _communicate_shapes (variable_seq_lengths=True)",),
        _apply_synchronize,
    ),
    CpuPatch(
        "cpu_rng_tracker",
        (
            "transformer/dot_product_attention.py DotProductAttention.forward: get_cuda_rng_tracker().fork()",
            "tensor_parallel/random.py model_parallel_cuda_manual_seed: tracker.add() (torch.cuda RNG states)",
        ),
        _apply_cpu_rng_tracker,
    ),
    CpuPatch(
        "tensor_type_names",
        (
            "optimizer/optimizer.py Float16OptimizerWithFloat16Params.__init__: param.type() checks",
            "optimizer/distrib_optimizer.py DistributedOptimizer._build_model_and_main_param_groups",
            "optimizer/clip_grads.py get_grad_norm_fp32 / clip_grad_by_total_norm_fp32",
        ),
        _push_mode(_CudaTypeNameMode),
    ),
)

_PATCHES_BY_NAME = {p.name: p for p in PATCHES}
_undo: dict[str, Undo] = {}


def needed() -> bool:
    """True when megatron-core needs this layer: CUDA is absent."""
    return not torch.cuda.is_available()


def install() -> None:
    """Apply every patch (idempotent). Does nothing when CUDA is available."""
    if not needed():
        return
    for patch in PATCHES:
        if patch.name not in _undo:
            _undo[patch.name] = patch.apply()


def uninstall() -> None:
    """Remove every applied patch, last applied first (the torch function modes form a stack)."""
    for name in reversed(list(_undo)):
        _undo.pop(name)()


def installed() -> list[str]:
    """Names of the patches currently applied."""
    return list(_undo)


@contextlib.contextmanager
def without(name: str) -> Iterator[None]:
    """Run a block with one patch removed (for tests that check the patch is still needed)."""
    if name not in _PATCHES_BY_NAME:
        raise KeyError(f"unknown cpu_compat patch {name!r}; known: {sorted(_PATCHES_BY_NAME)}")
    if name not in _undo:
        raise RuntimeError(f"cpu_compat patch {name!r} is not installed; call install() first")
    # Torch function modes form a stack: take off `name` and everything applied after it, put the others
    # back, and afterwards restore the original order.
    order = list(_undo)
    tail = order[order.index(name):]
    for other in reversed(tail):
        _undo.pop(other)()
    for other in tail[1:]:
        _undo[other] = _PATCHES_BY_NAME[other].apply()
    try:
        yield
    finally:
        for other in reversed(tail[1:]):
            _undo.pop(other)()
        for other in tail:
            _undo[other] = _PATCHES_BY_NAME[other].apply()
