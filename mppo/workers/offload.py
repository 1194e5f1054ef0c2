"""Trainer state out of device memory while the rollout engine generates, and back before training (veRL 0.9.1's
`<role>.megatron.param_offload` / `optimizer_offload`; the sequence is in mppo.rollout.factory).

- param_offload: each DDP chunk's contiguous parameter buffer is copied into a pinned host buffer (allocated once,
  then reused) and its device storage is freed; the gradient buffer's storage is freed without a copy (every update
  zeroes it before use). Parameters are views of these buffers, so freeing and restoring the storage in place
  keeps every parameter object, and the optimizer's references to them, valid (megatron-core's own buffer methods).
- optimizer_offload: the optimizer's fp32 main copies of bf16 parameters and its Adam moments move to host memory.

Reload restores both exactly (a copy back; grads come back zeroed), so training is bitwise what it would have been
without the offload (tests/dist/trainer_sglang.py checks this).

On a CPU-only run the trainer state already lives in host memory: `TrainerStateOffload` then does nothing (and
says so once in the log). The buffer mechanics themselves work on any device (`ParamBufferOffload` on a CPU
model frees and restores the storage), which is how the tests exercise them.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch
from torch import nn

log = logging.getLogger("mppo")


def _buffers(chunks: Sequence[nn.Module]) -> Iterator:
    """megatron DDP's parameter-and-gradient buffers of each chunk (none for a module that is not DDP-wrapped,
    whose `buffers` is nn.Module's method)."""
    for chunk in chunks:
        for attr in ("buffers", "expert_parallel_buffers"):
            found = getattr(chunk, attr, None)
            if isinstance(found, list):
                yield from found


class ParamBufferOffload:
    """One model's parameters and gradient buffers out of device memory and back (idempotent both ways).

    megatron-core's `_ParamAndGradBuffer.offload_to_cpu` / `reload_from_cpu` move its contiguous buffers: the
    gradient buffer always, the parameter buffer when it exists (with the distributed optimizer). Without it the
    parameters are separate tensors, moved here one by one (the Parameter objects stay, so the optimizer's
    references stay valid).
    """

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        self.chunks = list(chunks)
        self._loose: list[tuple[nn.Parameter, torch.device]] = []  # params outside a buffer, moved to host

    @torch.no_grad()
    def offload(self) -> None:
        buffers = list(_buffers(self.chunks))
        for buffer in buffers:
            if buffer.param_data is not None and not buffer.param_data.is_cuda and buffer.param_data_cpu is None:
                # megatron pins its host copy, which CPU-only torch cannot do: give it a plain one (tests)
                buffer.param_data_cpu = torch.empty_like(buffer.param_data, device="cpu")
            buffer.offload_to_cpu(move_params=True, move_grads=True)
        if self._loose:
            return
        in_buffers = {id(p) for b in buffers if b.param_data is not None for p in b.params}
        for chunk in self.chunks:
            for param in chunk.parameters():
                if id(param) not in in_buffers and param.device.type != "cpu":
                    self._loose.append((param, param.device))
                    param.data = param.data.to("cpu")

    @torch.no_grad()
    def reload(self) -> None:
        for buffer in _buffers(self.chunks):
            buffer.reload_from_cpu(move_params=True, move_grads=True)
        for param, device in self._loose:
            param.data = param.data.to(device)
        self._loose = []

    def device_bytes(self) -> int:
        """Bytes the parameter and gradient buffers hold in their storage now."""
        return sum((b.param_data.untyped_storage().size() if b.param_data is not None else 0)
                   + b.grad_data.untyped_storage().size() for b in _buffers(self.chunks))


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """The optimizer-owned tensors: fp32 main copies of low-precision params, and the Adam state."""
    for opt in _inner_optimizers(optimizer):
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, attr, None) or []:
                yield from (t for t in group if t is not None)
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            for state in inner.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


@torch.no_grad()
def move_optimizer_state(optimizer, device: torch.device) -> None:
    """Move the optimizer-owned tensors' data to `device` (in place: the tensor objects stay the same)."""
    for tensor in _optimizer_tensors(optimizer):
        if tensor.device != device:
            tensor.data = tensor.data.to(device)


class TrainerStateOffload:
    """What the rollout offloads before the engine's KV cache comes back and reloads after it is released
    (mppo.rollout.factory.TrainerState). `models`: (role, chunks, optimizer or None, param_offload,
    optimizer_offload) for each model. `active`: whether offload/reload move anything (False on the CPU, where the
    state is in host memory already; a test may set it to run the mechanics there)."""

    def __init__(self, models: Sequence[tuple[str, Sequence[nn.Module], object, bool, bool]],
                 device: torch.device) -> None:
        self.device = device
        self._params = [ParamBufferOffload(chunks) for _, chunks, _, params, _ in models if params]
        self._optimizers = [opt for _, _, opt, _, opt_offload in models if opt_offload]
        self.roles = [role for role, _, _, params, opt in models if params or opt]
        self.active = bool(self.roles) and device.type != "cpu"
        if self.roles and not self.active:
            log.info("param_offload/optimizer_offload of %s: nothing to do on the CPU (the trainer state is already "
                     "in host memory)", ", ".join(self.roles))

    def offload(self) -> None:
        if not self.active:
            return
        for params in self._params:
            params.offload()
        for optimizer in self._optimizers:
            move_optimizer_state(optimizer, torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if not self.active:
            return
        for params in self._params:
            params.reload()
        for optimizer in self._optimizers:
            move_optimizer_state(optimizer, self.device)
