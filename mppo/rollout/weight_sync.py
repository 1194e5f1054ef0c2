"""Actor -> rollout engine weight sync: the exporter's bucketed HF stream, fed to the engine where there is one.

The ranks that hold an engine are the exporter's destinations; every other rank of their model-parallel groups
only contributes its shards. On CPU (gloo, one host) that goes through shared-memory staging and the CPU engine
keeps the staged tensors as its weights (see mppo.models.weight_transport): one parallel copy per sync. On GPUs it
is the collective path into SGLang. Either way it is collective: call it on every rank of the actor.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.hf_config import HFModelArgs
from mppo.models.weight_export import export_group
from mppo.models.weights import bucketed, iter_hf_weights
from mppo.parallel import collective_device
from mppo.rollout.base import NamedTensor, RolloutEngine


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved on this rank: HF bytes streamed (0 where no engine), wall seconds, buckets."""

    bytes: int
    seconds: float
    buckets: int

    @property
    def bytes_per_s(self) -> float:
        if self.bytes == 0:  # nothing moved (the engines held these weights already)
            return 0.0
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def engine_ranks(engine: RolloutEngine | None) -> list[int]:
    """Global ranks of this rank's export group (its model-parallel group; with EP, the EP model-parallel groups
    that share one set of experts) that hold an engine (one small all-gather over the group)."""
    group = export_group()
    flag = torch.tensor([int(engine is not None)], device=collective_device(group))
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, flag, group=group)
    return [rank for rank, held in zip(dist.get_process_group_ranks(group), flags) if held.item()]


def push_actor_weights(engine: RolloutEngine | None, model_chunks: Sequence[nn.Module], hf_args: HFModelArgs,
                       bucket_bytes: int, *, dtype: torch.dtype | None = None, transport: str = "auto",
                       destinations: Sequence[int] | None = None) -> SyncStats:
    """Stream the actor's weights (HF names, full tensors, `bucket_bytes` buckets) into the engines.

    Collective over the actor's ranks: call it on every rank, with `engine=None` where this rank holds no engine.
    `destinations`: the global ranks that receive full weights (mppo.rollout.factory passes every rank of every
    rollout group); None: the ranks of this model-parallel group that hold an engine.
    `dtype` casts the exported tensors (e.g. bf16 for a bf16 engine); None keeps the parameter dtype. `transport`
    is iter_hf_weights' (auto: shared memory for gloo ranks on one host, else collectives).
    """
    counts = {"bytes": 0, "buckets": 0}

    def counted(buckets: Iterator[list[NamedTensor]]) -> Iterator[list[NamedTensor]]:
        for bucket in buckets:
            counts["buckets"] += 1
            counts["bytes"] += sum(t.nbytes for _, t in bucket)
            yield bucket

    start = time.perf_counter()
    if destinations is None:
        destinations = engine_ranks(engine)
    stream = counted(bucketed(iter_hf_weights(model_chunks, hf_args, dtype=dtype, destinations=destinations,
                                              transport=transport), bucket_bytes))
    if engine is None:
        for _ in stream:  # empty here, but this rank's shards are sent or staged from inside the generator
            pass
    else:
        engine.update_weights(stream)
    return SyncStats(bytes=counts["bytes"], seconds=time.perf_counter() - start, buckets=counts["buckets"])


def push_actor_adapters(engine: RolloutEngine | None, model_chunks: Sequence[nn.Module], hf_args: HFModelArgs,
                        bucket_bytes: int, *, destinations: Sequence[int] | None = None) -> SyncStats:
    """LoRA adapter-only sync (lora.merge=false): the frozen base while an engine holds none (the first sync),
    then the adapters alone, as full PEFT tensors, into every engine (SGLang's LoRA support applies them).

    Collective over the actor's ranks, like push_actor_weights (`engine=None` where this rank holds none)."""
    from mppo.models.lora import adapters_disabled, lora_info
    from mppo.models.lora_io import adapter_config, gather_peft_tensors

    start = time.perf_counter()
    world = dist.group.WORLD if dist.is_initialized() else None
    needs_base = torch.tensor([int(engine is not None and not engine.weights_loaded)],
                              device=collective_device(world))
    if world is not None:
        dist.all_reduce(needs_base, op=dist.ReduceOp.MAX)
    base = SyncStats(bytes=0, seconds=0.0, buckets=0)
    if needs_base.item():
        with adapters_disabled(model_chunks):  # the exporter then streams the base weights unmerged
            base = push_actor_weights(engine, model_chunks, hf_args, bucket_bytes, destinations=destinations)
    tensors = gather_peft_tensors(model_chunks)
    nbytes = 0
    if engine is not None:
        info = lora_info(model_chunks)
        engine.update_adapter(tensors, adapter_config(info.spec, info.base_dir))
        nbytes = sum(t.nbytes for t in tensors.values())
    return SyncStats(bytes=base.bytes + nbytes, seconds=time.perf_counter() - start,
                     buckets=base.buckets + int(nbytes > 0))


__all__ = ["SyncStats", "engine_ranks", "push_actor_adapters", "push_actor_weights"]
