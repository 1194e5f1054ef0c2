"""Host-local staging for the CPU weight export: a shared-memory landing zone per model and destination rank.

Why: on CPU (gloo) the collective export moves every byte through TCP loopback, at a few percent of memcpy. When all
ranks of a model-parallel group share one host, every rank can instead write its shards straight into the
destination's buffer, already in HF layout (un-fusing QKV / gate-up and cutting vocabulary padding on the way), and
the destination hands out views of that buffer: one copy per sync, done by all ranks at once. On GPUs the sync is
NCCL plus CUDA IPC handles into SGLang instead (mppo.rollout.sglang_engine), so the exporter stages only gloo groups.

A StagingBuffer exists on every rank of a model-parallel group, one per exported model and destination of that
group, and is kept for the model's later exports (first touches of fresh pages are slow, in VMs especially):
- created by the first export (or when the HF layout changes): the destination creates a /dev/shm file of the full
  size with posix_fallocate (a /dev/shm too small for it is a clear error here, not a SIGBUS later), every rank of
  the group maps it, and the destination unlinks it at once. From then on the memory lives exactly as long as some
  mapping does, so no file outlives the setup, whether an export finishes, fails or a rank dies.
- per export (mppo.models.weight_export.iter_hf_weights): the handshake at the start is also the start barrier
  (nobody writes until every rank, the destination included, has finished with the previous export), then every
  rank writes its shards, a barrier, and the destination yields views.
- it goes with its model (weak reference) or with `release_staging_buffers()`; an export after either sets up anew.
  Every rank reports what it holds in the handshake, so ranks that disagree rebuild rather than hang.

Views handed out are *staged* (`is_staged`): nothing writes them again except the next export of the same model to
the same destination, which writes the next values of the same weights into the same places. A consumer may
therefore keep them as its weights instead of copying them (the CPU rollout engine does; its weights then live in
the buffer and each export updates them in place, which is what update_weights would do anyway).
"""
from __future__ import annotations

import hashlib
import os
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "mppo-weights-"
_ALIGN = 64  # bytes; every view starts on a cache line, whatever the dtype


class StagingError(RuntimeError):
    """Setting up a shared-memory staging buffer failed on some rank (raised on every rank of the group)."""


@dataclass(frozen=True)
class Slot:
    """One HF tensor's place in a staging buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def layout_signature(slots: Sequence[Slot]) -> str:
    """A short digest of names, shapes and dtypes: buffers are reused only for the same HF layout."""
    text = repr([(s.name, s.shape, str(s.dtype)) for s in slots])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _offsets(slots: Sequence[Slot]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for slot in slots:
        start = -(-end // _ALIGN) * _ALIGN
        offsets.append(start)
        end = start + slot.nbytes
    return offsets, max(end, 1)


class StagingBuffer:
    """A mapped shared-memory segment holding one full HF model, sliced into one view per tensor."""

    def __init__(self, storage: torch.UntypedStorage, slots: Sequence[Slot], segment: str, signature: str):
        self.segment, self.signature = segment, signature
        self.storage_ptr = storage.data_ptr()
        base = torch.empty(0, dtype=torch.uint8).set_(storage)
        offsets, _ = _offsets(slots)
        self._views = {s.name: base[o:o + s.nbytes].view(s.dtype).view(s.shape) for s, o in zip(slots, offsets)}

    def view(self, name: str) -> torch.Tensor:
        return self._views[name]


# model -> (global ranks of the model-parallel group, destination global rank) -> this process's mapping of that
# buffer. One set per model, so exporting another model (a reference policy, a critic checkpoint) to the same rank
# never rewrites the buffer an engine kept as its weights; a model's buffers go when the model does.
_BUFFERS: weakref.WeakKeyDictionary[object, dict[tuple[tuple[int, ...], int], StagingBuffer]] = \
    weakref.WeakKeyDictionary()


def _all_buffers() -> list[StagingBuffer]:
    return [buffer for buffers in list(_BUFFERS.values()) for buffer in buffers.values()]


def state_digest(model: object, group_ranks: Sequence[int], destinations: Sequence[int]) -> int:
    """A digest of the buffers this rank holds for `model`'s export to `destinations` (0 if it lacks one), exchanged
    before `prepare`. Equal non-zero digests on every rank mean every rank maps the same segments and layouts."""
    key, held = tuple(group_ranks), _BUFFERS.get(model, {})
    if any((key, d) not in held for d in destinations):
        return 0
    state = [(d, held[key, d].segment, held[key, d].signature) for d in destinations]
    return int.from_bytes(hashlib.sha256(repr(state).encode()).digest()[:8], "little") >> 1 or 1


def prepare(model: object, group: dist.ProcessGroup, group_ranks: Sequence[int], destinations: Sequence[int],
            slots: Sequence[Slot], digests: Sequence[int]) -> dict[int, StagingBuffer]:
    """`model`'s staging buffer for every destination, mapped on this rank: reused when every rank reported the same
    `state_digest` and it is for this layout, else all (re)created, collectively over `group`. Every rank takes the
    same decision: equal digests mean equal segments and signatures everywhere."""
    key, signature = tuple(group_ranks), layout_signature(slots)
    held = _BUFFERS.setdefault(model, {})
    reusable = (len(set(digests)) == 1 and digests[0] != 0
                and all(held[key, d].signature == signature for d in destinations))
    if not reusable:
        for d in destinations:
            held.pop((key, d), None)
        storages = _create_and_map(group, destinations, _offsets(slots)[1])
        for d, (segment, storage) in storages.items():
            held[key, d] = StagingBuffer(storage, slots, segment, signature)
    return {d: held[key, d] for d in destinations}


def _create_and_map(group: dist.ProcessGroup, destinations: Sequence[int],
                    nbytes: int) -> dict[int, tuple[str, torch.UntypedStorage]]:
    """Destinations create (and fully allocate) their segment files, every rank maps them, destinations unlink."""
    mine = SHM_DIR / f"{SEGMENT_PREFIX}{secrets.token_hex(8)}" if dist.get_rank() in destinations else None
    try:
        error = _create_segment(mine, nbytes) if mine is not None else None
        names = _agree(group, error, mine.name if mine is not None else None, "creating the staging buffers")
        storages, error = {}, None
        for d in destinations:
            try:
                storages[d] = names[d], torch.UntypedStorage.from_file(str(SHM_DIR / names[d]), shared=True,
                                                                       nbytes=nbytes)
            except (OSError, RuntimeError) as err:
                error = f"mapping {SHM_DIR / names[d]}: {err}"
                break
        _agree(group, error, None, "mapping the staging buffers")
        return storages
    finally:
        if mine is not None:  # every rank has mapped it (or failed): the name is no longer needed
            mine.unlink(missing_ok=True)


def _create_segment(path: Path, nbytes: int) -> str | None:
    """Create and allocate `path`; an error message instead of an exception so that every rank can hear of it."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as err:
        return f"cannot create {path}: {err}"
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as err:
        free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
        return (f"{SHM_DIR} has {free / 2**20:.0f} MiB free but the weight staging buffer needs {nbytes / 2**20:.0f} "
                f"MiB ({err}); enlarge {SHM_DIR} (e.g. docker run --shm-size) or use transport='collective'")
    finally:
        os.close(fd)
    return None


def _agree(group: dist.ProcessGroup, error: str | None, name: str | None, what: str) -> dict[int, str]:
    """Gather every rank's (error, segment name); raise the same StagingError on every rank if any failed, else
    return the segment names by rank."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (dist.get_rank(), error, name), group=group)
    failed = [f"rank {rank}: {msg}" for rank, msg, _ in gathered if msg is not None]
    if failed:
        raise StagingError(f"{what} failed: " + "; ".join(failed))
    return {rank: name for rank, _, name in gathered if name is not None}


def is_staged(tensor: torch.Tensor) -> bool:
    """True for a view into one of this process's staging buffers (see the module docstring for what that allows)."""
    if tensor.device.type != "cpu":
        return False
    ptr = tensor.untyped_storage().data_ptr()
    return any(buffer.storage_ptr == ptr for buffer in _all_buffers())


def held_segments() -> list[str]:
    """Names of the (already unlinked) segments behind this process's staging buffers, for leak checks."""
    return [buffer.segment for buffer in _all_buffers()]


def release_staging_buffers() -> None:
    """Drop this process's staging buffers; memory returns once no tensor views it (an engine that kept staged
    weights holds its buffer until it releases them). Call it on every rank of the groups concerned."""
    _BUFFERS.clear()


__all__ = ["SEGMENT_PREFIX", "SHM_DIR", "Slot", "StagingBuffer", "StagingError", "held_segments", "is_staged",
           "layout_signature", "prepare", "release_staging_buffers", "state_digest"]
