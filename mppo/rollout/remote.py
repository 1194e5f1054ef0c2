"""Rollout across the split (`actor_rollout_ref.hybrid_engine=false`): the trainer's `RemoteRollout`, the engine
ranks' `serve_engine`, and the versioned weight stream between them (mppo.parallel.placement makes the bridge).

The engine ranks run `serve_engine`: the launch's rollout (mppo.rollout.factory, its engine groups formed over the
engine ranks' own world) driven by messages the first trainer rank broadcasts over the bridge's control group, one
at a time, in order:

    hello     the trainer's parameter dtype; the engines start
    weights   version v: the actor's HF weights follow in buckets (bucket layouts on the weights' gloo group, the
              bytes on the weights group: gloo on CPU, NCCL on GPUs); the engines load them and keep them
    generate  global prompts, sampling, step, first index: the engines generate, the first engine rank broadcasts
              every response (with the weight version and the engine's generation interval) to every rank
    stop      the engines shut down

Every rank of the launch takes part in each control and answer broadcast (trainer ranks other than the first only
receive), so both sides see the same sequences. Messages and answers travel on two groups of their own
(mppo.parallel.placement.Bridge), and on the engine ranks a receiver thread takes every message as it comes (a
weight stream is received whole, into fresh host buffers) and queues it, and a sender thread broadcasts the answers,
while the main thread serves the queue in order. So the trainer can keep up to k generations outstanding
(async_training.max_off_policy_steps = k; `prefetch` sends a request and returns at once) and push a new weight
version while they run: the engines load it after the generations asked for before it, and the requests after it
run on it. `generate` of a prefetched request collects the answers up to its own, in order. An answer the
trainer has not collected yet waits on the sender thread (bounded by trainer.collective_timeout_s); a new weight
version waits for the generations in flight before it, unless async_training.partial_rollout: then it interrupts
the generation in flight, which goes on on it (mppo.rollout.partial), and the requests queued before it run on it
too.

A checkpoint keeps the generation in flight (`prefetched`, `restore`; written by mppo.trainer.offpolicy): a resumed
run trains on the very responses the uninterrupted run would have, generated on the weights one version back.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mppo.config import MppoConfig
from mppo.models.hf_config import HFModelArgs
from mppo.parallel.placement import Side
from mppo.rollout.base import NamedTensor, RolloutResponse, SamplingParams
from mppo.rollout.factory import build_rollout, launch_layout, pack_responses, stamp_version, unpack_responses
from mppo.rollout.partial import WeightSwitch
from mppo.rollout.weight_sync import SyncStats, push_actor_weights

log = logging.getLogger("mppo")
_ALIGN = 64  # bytes: every tensor of a bucket starts on a cache line, whatever its dtype


@dataclass(frozen=True)
class GenerationRecord:
    """One generation the engines served: the weight version it used and when it ran (time.time() on the first
    engine rank), how long the trainer waited for it and when it had it (time.time())."""

    version: int
    start: float
    end: float
    trainer_wait_s: float
    collected: float
    # partial rollouts: of `responses`, those whose tokens span more than one version; of `tokens`, those
    # generated on a newer version than the response's first
    responses: int = 0
    resumed: int = 0
    tokens: int = 0
    newer_tokens: int = 0


def partial_counts(responses: list[RolloutResponse]) -> dict[str, int]:
    """GenerationRecord's partial-rollout counts of these responses (all 0 without token versions)."""
    spans = [r.token_versions for r in responses if r.token_versions]
    return {"responses": len(spans), "resumed": sum(v[0] != v[-1] for v in spans),
            "tokens": sum(len(v) for v in spans), "newer_tokens": sum(len(v) - v.count(v[0]) for v in spans)}


@dataclass
class _Request:
    key: tuple
    received: list[RolloutResponse] | None = None
    record: GenerationRecord | None = None


# ---------------------------------------------------------------------------------------------- the weight stream
def _pack_bucket(bucket: list[NamedTensor], device: torch.device) -> tuple[list[tuple], torch.Tensor]:
    """One flat byte buffer of the bucket's tensors and their (name, shape, dtype, offset) layout."""
    layout, end = [], 0
    for name, tensor in bucket:
        start = -(-end // _ALIGN) * _ALIGN
        layout.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), start))
        end = start + tensor.nbytes
    flat = torch.empty(max(end, 1), dtype=torch.uint8, device=device)
    for (_, _, _, start), (_, tensor) in zip(layout, bucket):
        flat[start:start + tensor.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return layout, flat


def _unpack_bucket(layout: list[tuple], flat: torch.Tensor) -> list[NamedTensor]:
    out = []
    for name, shape, dtype, start in layout:
        dt = getattr(torch, dtype)
        numel = 1
        for size in shape:
            numel *= size
        out.append((name, flat[start:start + numel * dt.itemsize].view(dt).view(shape)))
    return out


class _BridgeSender:
    """What push_actor_weights feeds on the first trainer rank: each bucket across the bridge to every engine."""

    def __init__(self, side: Side) -> None:
        self.bridge = side.bridge

    def update_weights(self, buckets: Iterator[list[NamedTensor]]) -> None:
        src = self.bridge.weight_ranks[0]
        for bucket in buckets:
            layout, flat = _pack_bucket(bucket, self.bridge.device)
            self.bridge.broadcast_object((layout, flat.numel()), src, weights=True)
            self.bridge.broadcast_weights(flat)
        self.bridge.broadcast_object(None, src, weights=True)


def _received_buckets(side: Side) -> Iterator[list[NamedTensor]]:
    """The engine ranks' side of _BridgeSender: buckets of views into freshly received buffers, in host memory (a
    bucket received on a GPU is copied out at once: versions queued behind generations must not hold GPU memory
    the engine needs; `_on_device` brings them back one bucket at a time as the engine loads them)."""
    bridge = side.bridge
    while True:
        head = bridge.broadcast_object(None, bridge.weight_ranks[0], weights=True)
        if head is None:
            return
        layout, nbytes = head
        flat = torch.empty(nbytes, dtype=torch.uint8, device=bridge.device)
        bridge.broadcast_weights(flat)
        if flat.is_cuda:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            flat = host.copy_(flat)
        yield _unpack_bucket(layout, flat)


def _on_device(buckets: list[list[NamedTensor]], device: torch.device) -> Iterator[list[NamedTensor]]:
    """A received weight stream on `device`, one bucket at a time."""
    for bucket in buckets:
        yield [(name, tensor.to(device, non_blocking=True)) for name, tensor in bucket]


# ---------------------------------------------------------------------------------------------- the trainer's side
class RemoteRollout:
    """The trainer ranks' Rollout when the engines live on their own ranks: the calls of mppo.rollout.factory's
    Rollout (each collective over the trainer ranks), plus `prefetch` for the off-policy pipeline."""

    def __init__(self, cfg: MppoConfig, side: Side, *, dtype: torch.dtype) -> None:
        self.side, self.bridge = side, side.bridge
        self.name = cfg.actor_rollout_ref.rollout.name
        self._driver, self._engine0 = side.placement.trainer_ranks[0], side.placement.engine_ranks[0]
        self.engine_version: int | None = None  # the weight version the engines hold (or will, once queued)
        self._outstanding: collections.deque[_Request] = collections.deque()  # asked for, in request order
        self._ready: list[_Request] = []  # collected, not yet asked for
        self.records: list[GenerationRecord] = []  # since the last take_records()
        self.last_record: GenerationRecord | None = None  # the generation the last generate() returned
        self._send({"op": "hello", "dtype": str(dtype).removeprefix("torch.")})

    def _send(self, message: dict[str, Any]) -> None:
        self.bridge.broadcast_object(message if self.bridge.rank == self._driver else None, self._driver)

    def _collect_one(self) -> None:
        """The answer to the oldest outstanding request (the engines answer in request order)."""
        request = self._outstanding.popleft()
        began = time.perf_counter()
        answer = self.bridge.broadcast_object(None, self._engine0, answers=True)
        wait = time.perf_counter() - began
        version = answer["version"]
        request.received = stamp_version(unpack_responses(answer["packed"]), version)
        request.record = GenerationRecord(version, answer["start"], answer["end"], wait, time.time(),
                                          **partial_counts(request.received))
        self.records.append(request.record)
        self._ready.append(request)

    def sync_weights(self, model_chunks: Sequence[nn.Module], hf_args: HFModelArgs, *, bucket_bytes: int,
                     trainer_state: Any = None, version: int = 0) -> SyncStats:
        """The actor's weights as `version` into every engine (nothing moves when they hold it already); the
        engines load them after the generations already asked for. `trainer_state` is not offloaded: no engine
        shares the trainer's memory."""
        if self.engine_version == version:
            return SyncStats(bytes=0, seconds=0.0, buckets=0)
        self._send({"op": "weights", "version": version})
        sender = _BridgeSender(self.side) if self.bridge.rank == self._driver else None
        stats = push_actor_weights(sender, model_chunks, hf_args, bucket_bytes, destinations=[0])
        self.engine_version = version
        return stats

    def prefetch(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, step: int,
                 first_index: int = 0) -> None:
        """Ask the engines for `generate(prompts, ...)` on the weights they hold once the requests before it are
        served, and return at once (nothing when this request is asked for already)."""
        key = request_key(prompts, sampling, step, first_index)
        if any(r.key == key for r in (*self._outstanding, *self._ready)):
            return
        self._send({"op": "generate", "prompts": [list(p) for p in prompts], "sampling": dataclasses.asdict(sampling),
                    "step": step, "first_index": first_index})
        self._outstanding.append(_Request(key))

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, step: int,
                 first_index: int = 0, agent: Any = None) -> list[RolloutResponse]:
        """Every response to the GLOBAL `prompts`, on every trainer rank: a prefetched generation of the same
        request if there is one (whatever weights it ran on: each response carries its `policy_version`), else
        one on the engines' weights after the requests outstanding."""
        if agent is not None:
            raise ValueError("multi-turn rollout is not built for actor_rollout_ref.hybrid_engine=false")
        key = request_key(prompts, sampling, step, first_index)
        self.prefetch(prompts, sampling, step=step, first_index=first_index)
        while not any(r.key == key for r in self._ready):
            self._collect_one()
        request = self._ready.pop(next(i for i, r in enumerate(self._ready) if r.key == key))
        self.last_record = request.record
        return request.received

    def has_prefetched(self) -> bool:
        """Whether a prefetched generation is in flight or collected and not yet asked for (the same on every
        trainer rank: they all make the same calls)."""
        return bool(self._outstanding) or bool(self._ready)

    def prefetched(self) -> list[tuple[tuple, list[RolloutResponse], GenerationRecord]]:
        """The prefetched generations not yet asked for, as (request key, responses, record), those in flight
        collected first (a wait on every rank: the checkpoint that keeps them calls this after writing the models,
        so the engines finish meanwhile). They stay here for the `generate` that asks for them."""
        while self._outstanding:
            self._collect_one()
        return [(r.key, r.received, r.record) for r in self._ready]

    def restore(self, key: tuple, responses: list[RolloutResponse], record: GenerationRecord) -> None:
        """A prefetched generation a checkpoint kept (`prefetched` of the saved run): the next `generate` of the same
        request returns it instead of asking the engines."""
        self._ready.append(_Request(key, responses, record))

    def take_records(self) -> list[GenerationRecord]:
        records, self.records = self.records, []
        return records

    def release(self) -> None:
        """Nothing to free: the engines keep their weights and KV cache (no trainer state shares their memory)."""

    def shutdown(self) -> None:
        """Stop the engines, after collecting what they were asked for (their sender threads wait to answer it)."""
        while self._outstanding:
            self._collect_one()
        self._send({"op": "stop"})
        self._ready.clear()


def request_key(prompts: Sequence[Sequence[int]], sampling: SamplingParams | str, step: int,
                first_index: int) -> tuple:
    """What identifies a request (`sampling`, or its repr as a checkpoint saved it)."""
    sampling = sampling if isinstance(sampling, str) else repr(sampling)
    return (step, first_index, sampling, tuple(tuple(p) for p in prompts))


# ---------------------------------------------------------------------------------------------- the engines' side
def serve_engine(cfg: MppoConfig, side: Side, *, run_dir: Path) -> int:
    """The engine ranks' program: start the engines, serve the trainer's messages in order until `stop`."""
    bridge = side.bridge
    is_first = bridge.rank == side.placement.engine_ranks[0]
    inbox = _Inbox()
    outbox: queue.Queue = queue.Queue()
    failed: list[BaseException] = []  # the sender thread's error, raised here (the trainer would only time out)
    receiver = threading.Thread(target=_receive, args=(side, inbox), name="mppo-rollout-inbox", daemon=True)
    sender = threading.Thread(target=_answer, args=(side, outbox, failed), name="mppo-rollout-outbox", daemon=True)
    receiver.start()
    sender.start()
    rollout, version = None, None

    def load(message: dict[str, Any]) -> int:
        rollout.engine.update_weights(_on_device(message["buckets"], bridge.device))
        rollout.engine.resume()
        return message["version"]

    while True:
        message = inbox.get()
        if isinstance(message, BaseException):  # the receiver failed: so does the engine side, with its error
            raise message
        if failed:
            raise failed[0]
        op = message["op"]
        if op == "stop":
            break
        if op == "hello":
            rollout = build_rollout(cfg, device=bridge.device, dtype=getattr(torch, message["dtype"]),
                                    log_dir=run_dir / "rollout",
                                    layout=launch_layout(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size,
                                                         local_world=side.placement.engines_per_node))
        elif op == "weights":
            version = load(message)
        elif op == "generate":
            start = time.time()
            switch = None
            if cfg.async_training.partial_rollout:
                switch = WeightSwitch(pending=inbox.weights_pending, version=version,
                                      load_newest=lambda: load(inbox.take_newest_weights()))
            responses = rollout.generate(message["prompts"], SamplingParams(**message["sampling"]),
                                         step=message["step"], first_index=message["first_index"], partial=switch)
            answer = {"version": version, "start": start, "end": time.time(), "packed": pack_responses(responses)}
            version = version if switch is None else switch.version
            outbox.put(answer if is_first else None)
        else:
            raise ValueError(f"unknown rollout message {op!r}")
    outbox.put(_STOP)
    sender.join()  # every answer is out (the trainer collects them all before it sends stop)
    receiver.join()
    if rollout is not None:
        rollout.shutdown()
    return 0


_STOP = object()  # the main thread to the sender thread: every answer is queued


class _Inbox:
    """The receiver thread's messages in order, and how many weight versions among them the main thread has not
    taken yet: partial rollouts take the newest ahead of its turn (`take_newest_weights`)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._backlog: collections.deque = collections.deque()  # taken off the queue, not yet served
        self._lock = threading.Lock()
        self._weights = 0

    def put(self, message: Any) -> None:
        """The receiver thread's side."""
        self._queue.put(message)
        if _is_weights(message):  # counted once queued: a count > 0 means a version is there to take
            with self._lock:
                self._weights += 1

    def get(self) -> Any:
        message = self._backlog.popleft() if self._backlog else self._queue.get()
        self._took(message)
        return message

    def weights_pending(self) -> bool:
        return self._weights > 0

    def take_newest_weights(self) -> dict[str, Any]:
        """The newest weight version received; older ones not loaded yet are dropped (superseded), the other
        messages keep their order. Waits for one when none is here yet (an SGLang group's other ranks: its
        driver saw the version arrive first)."""
        while True:
            try:
                self._backlog.append(self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            if any(_is_weights(m) for m in self._backlog):
                break
            if any(isinstance(m, BaseException) or m["op"] == "stop" for m in self._backlog):
                raise RuntimeError("partial rollout: the engine side stopped (or its receiver failed) before the "
                                   "weight update this engine group's driver saw arrived")
            self._backlog.append(self._queue.get())  # the receiver's next message (it has its own timeout)
        versions = [m for m in self._backlog if _is_weights(m)]
        for message in versions:
            self._backlog.remove(message)
            self._took(message)
        for message in versions[:-1]:
            log.info("partial rollout: weight version %d superseded by %d before it was loaded", message["version"],
                     versions[-1]["version"])
        return versions[-1]

    def _took(self, message: Any) -> None:
        if _is_weights(message):
            with self._lock:
                self._weights -= 1


def _is_weights(message: Any) -> bool:
    return isinstance(message, dict) and message["op"] == "weights"


def _receive(side: Side, inbox: _Inbox) -> None:
    """The engine ranks' receiver thread: every message of the first trainer rank, as it comes, into `inbox`; a
    weight stream is received whole first (the engines may be generating: they load it when they get to it)."""
    bridge, driver = side.bridge, side.placement.trainer_ranks[0]
    try:
        while True:
            message = bridge.broadcast_object(None, driver)
            if message["op"] == "weights":
                message["buckets"] = list(_received_buckets(side))
            inbox.put(message)
            if message["op"] == "stop":
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
        inbox.put(exc)


def _answer(side: Side, outbox: queue.Queue, failed: list[BaseException]) -> None:
    """The engine ranks' sender thread: each answer (the first engine rank's; None elsewhere) to every rank, in
    order, so the engines go on generating while the trainer has not collected it yet. Its error goes to
    `failed`, which the main thread raises at its next message."""
    root = side.placement.engine_ranks[0]
    try:
        while (answer := outbox.get()) is not _STOP:
            side.bridge.broadcast_object(answer, root, answers=True)
    except BaseException as exc:  # noqa: BLE001 - raised by the main thread
        log.exception("the engine side could not send a rollout answer to the trainer")
        failed.append(exc)


__all__ = ["GenerationRecord", "RemoteRollout", "partial_counts", "request_key", "serve_engine"]
