"""Run megatron-core 0.16.1 on a machine without CUDA (gloo, CPU tensors), and so without Transformer Engine.

megatron-core assumes CUDA in a few dozen places. Every one of them falls into one of the patches below; each
patch lists the call sites it serves. `install()` applies those whose condition holds: the CUDA patches only when
`torch.cuda.is_available()` is False (on a GPU machine they never run), the one Transformer Engine patch whenever
TE does not import (any CPU machine; a GPU machine without TE). `mppo.parallel.init_distributed` calls it.

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
    applies: Callable[[], bool] = lambda: not torch.cuda.is_available()  # whether this machine needs it


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
    """Rewrites CUDA device arguments to CPU, makes `Tensor.cuda()` a no-op and drops `pin_memory=True` (host
    memory pinned for CUDA copies; CPU-only torch has no allocator for it)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
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


class _InertEvent:
    """A CUDA event stand-in: on CPU every operation has completed when it returns."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _InertStream:
    """A CUDA stream stand-in: CPU ops run in program order, so waiting and recording are no-ops. A class, since
    torch.cuda.Stream also appears in annotations (`torch.cuda.Stream | None` in transformers)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _InertEvent:
        return _InertEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _InertStream()


def _apply_cuda_streams() -> Undo:
    undos = [_set_attr(torch.cuda, "Stream", _InertStream),
             _set_attr(torch.cuda, "current_stream", lambda device=None: _CURRENT_STREAM),
             _set_attr(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())]

    def undo() -> None:
        for one in reversed(undos):
            one()

    return undo


def _apply_splits_as_numpy() -> Undo:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        # On CUDA the DtoH copy also turns the split sizes into numpy; a CPU tensor is "already there" and would be
        # handed to all_to_all_single as a tensor, which gloo's binding rejects.
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return _set_attr(token_dispatcher, "maybe_move_tensor_to_cpu", move)


def _backward_under_device_mode(functions: list[type]) -> Undo:
    """Run the `backward` of these autograd Functions under the CUDA-to-CPU device mode."""
    originals = {}  # Function class -> its own `backward` entry (a staticmethod), put back by undo
    for cls in functions:
        originals[cls] = vars(cls)["backward"]

        def backward(ctx, *grads, _original=originals[cls].__func__):
            with _CudaDeviceToCpuMode():
                return _original(ctx, *grads)

        cls.backward = staticmethod(backward)

    def undo() -> None:
        for cls, original in originals.items():
            cls.backward = original

    return undo


def _apply_backward_device_mode() -> Undo:
    """Every communication autograd Function of megatron's tensor_parallel/mappings.py."""
    from megatron.core.tensor_parallel import mappings

    return _backward_under_device_mode(
        [value for value in list(vars(mappings).values())
         if isinstance(value, type) and issubclass(value, torch.autograd.Function) and "backward" in vars(value)])


def _apply_sequence_parallel_backward() -> Undo:
    from megatron.core.tensor_parallel import layers

    return _backward_under_device_mode([layers.LinearWithGradAccumulationAndAsyncCommunication])


def _apply_uneven_sequence_collectives() -> Undo:
    """megatron's all-gather / reduce-scatter along the first dimension with per-rank sizes, on gloo: gloo's
    all_gather needs equal sizes and it has no list reduce_scatter. Equal-size calls go to megatron's own."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return gather(input_, group, output_split_sizes, use_global_buffer)
        # pad every rank's part to the largest, gather equal parts, cut the padding off again
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[:input_.shape[0]] = input_
        parts = input_.new_empty((group.size() * longest, *input_.shape[1:]))
        dist.all_gather_into_tensor(parts, padded.contiguous(), group=group)
        return torch.cat([parts[i * longest:i * longest + n] for i, n in enumerate(output_split_sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        # the sum of every rank's whole tensor, of which this rank keeps its part
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[:group.rank()])
        return total[start:start + input_split_sizes[group.rank()]].clone()

    undo_gather = _set_attr(mappings, "_gather_along_first_dim", gather_uneven)
    undo_reduce_scatter = _set_attr(mappings, "_reduce_scatter_along_first_dim", reduce_scatter_uneven)
    return lambda: (undo_reduce_scatter(), undo_gather())


def _transformer_engine_missing() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or OSError for missing CUDA libraries
        return True
    return False


def _apply_te_general_gemm() -> Undo:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return lambda: None
    moe_utils.te_general_gemm = None  # what "TE has no GEMM for this" means to its only reader
    return lambda: delattr(moe_utils, "te_general_gemm")


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
            "models/common/embeddings/rope_utils.py get_pos_emb_on_this_cp_rank (context parallelism): "
            "torch.tensor(..., pin_memory=True).cuda(non_blocking=True)",
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
    CpuPatch(
        "cuda_streams",
        (
            "transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher.__init__: torch.cuda.Stream()",
            "transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: "
            "current_stream(), stream(...), record_event(), event.synchronize()",
        ),
        _apply_cuda_streams,
    ),
    CpuPatch(
        "backward_device_mode",
        ("tensor_parallel/mappings.py _AllToAll.backward (MoE token dispatch): a custom autograd Function's backward "
         "runs with no torch-function mode active, so its new_empty(device=torch.cuda.current_device()) reaches "
         "torch unrewritten; the same holds for every backward in mappings.py",),
        _apply_backward_device_mode,
    ),
    CpuPatch(
        "sequence_parallel_backward",
        ("tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication.backward (every TP linear under "
         "sequence parallelism): torch.empty(device=torch.cuda.current_device()) for the reduce-scattered input "
         "gradient, in a backward that runs with no torch-function mode active",),
        _apply_sequence_parallel_backward,
    ),
    CpuPatch(
        "uneven_sequence_collectives",
        ("tensor_parallel/mappings.py _gather_along_first_dim / _reduce_scatter_along_first_dim with split sizes: "
         "the MoE token dispatcher under TP gathers and reduce-scatters each TP rank's routed tokens, a different "
         "count per rank (gloo: 'allgather: invalid tensor size'; no list reduce_scatter)",),
        _apply_uneven_sequence_collectives,
    ),
    CpuPatch(
        "splits_as_numpy",
        ("transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: "
         "maybe_move_tensor_to_cpu(input_splits/output_splits, as_numpy=True) converts only CUDA tensors, so on CPU "
         "the all-to-all split sizes reach all_to_all_single as tensors (TypeError in gloo's binding)",),
        _apply_splits_as_numpy,
    ),
    CpuPatch(
        "te_general_gemm",
        ("transformer/moe/moe_utils.py RouterGatingLinearFunction.forward: reads te_general_gemm, which the module "
         "defines only when Transformer Engine imports (NameError in every MoE router without TE)",),
        _apply_te_general_gemm,
        applies=_transformer_engine_missing,
    ),
)

_PATCHES_BY_NAME = {p.name: p for p in PATCHES}
_undo: dict[str, Undo] = {}


def needed() -> bool:
    """True when megatron-core needs some patch here: CUDA or Transformer Engine is absent."""
    return any(patch.applies() for patch in PATCHES)


def install() -> None:
    """Apply every patch this machine needs (idempotent). On a GPU machine with TE it does nothing."""
    for patch in PATCHES:
        if patch.name not in _undo and patch.applies():
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
