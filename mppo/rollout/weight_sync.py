"""Actor -> rollout engine weight sync: the exporter's bucketed HF stream, fed to the engine where there is one.

`iter_hf_weights` is collective (TP all-gathers, PP broadcasts), so EVERY rank of the actor must consume the whole
stream, engine or not. Ranks that hold an engine object pass it in and it reads the stream; the others drain it.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mppo.models.hf_config import HFModelArgs
from mppo.models.weights import bucketed, iter_hf_weights
from mppo.rollout.base import NamedTensor, RolloutEngine


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved on this rank: HF bytes streamed, wall seconds, buckets."""

    bytes: int
    seconds: float
    buckets: int

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else float("inf")


def push_actor_weights(engine: RolloutEngine | None, model_chunks: Sequence[nn.Module], hf_args: HFModelArgs,
                       bucket_bytes: int, *, dtype: torch.dtype | None = None) -> SyncStats:
    """Stream the actor's weights (HF names, full tensors, `bucket_bytes` buckets) into `engine`.

    Collective over the actor's ranks: call it on every rank, with `engine=None` where this rank holds no engine.
    `dtype` casts the exported tensors (e.g. bf16 for a bf16 engine); None keeps the parameter dtype.
    """
    counts = {"bytes": 0, "buckets": 0}

    def counted(buckets: Iterator[list[NamedTensor]]) -> Iterator[list[NamedTensor]]:
        for bucket in buckets:
            counts["buckets"] += 1
            counts["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket

    start = time.perf_counter()
    stream = counted(bucketed(iter_hf_weights(model_chunks, hf_args, dtype=dtype), bucket_bytes))
    if engine is None:
        for _ in stream:  # the collectives inside the exporter need every rank
            pass
    else:
        engine.update_weights(stream)
    return SyncStats(bytes=counts["bytes"], seconds=time.perf_counter() - start, buckets=counts["buckets"])


__all__ = ["SyncStats", "push_actor_weights"]
