"""Megatron -> HF export: full HF tensors for the destination ranks, by collectives or by shared-memory staging.

Every rank of an export group runs `iter_hf_weights` to its end; the destinations get `(hf_name, tensor)` pairs in
HF order, the other ranks an empty stream. The export group is the model-parallel group (the TP x PP ranks of one
DP replica); with expert parallelism (EP > 1) it is the EP such groups that together hold every expert (megatron's
expert-tensor-model-pipeline group): each EP replica serves its dense weights itself, a routed expert's weights
come from the one EP rank that holds them. The layout mapping is
mppo.models.weight_rules (`place_shard` un-fuses a TP shard into its places in the HF tensors), the host-local
transport is mppo.models.weight_transport.

Per export each group runs one small handshake (a fixed-size all-gather of digests: the plan, the last full
exchange, the staging buffers). Only when something changed (the first export, another dtype or destination set,
a released buffer) does the full exchange follow: plans, host names and places, pickled. The handshake is also
the start barrier of a staged export: no rank writes into a destination's buffer before the destination has
started this export, i.e. finished with the previous one.
"""
from __future__ import annotations

import hashlib
import socket
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mppo.models import weight_transport
from mppo.models.builders import unwrap_model
from mppo.models.hf_config import HFModelArgs
from mppo.models.lora import export_parameters
from mppo.parallel import collective_device
from mppo.models.weight_rules import (
    WeightRule,
    full_shapes,
    place_shard,
    tp_layout,
    weight_rule,
)

TRANSPORTS = ("auto", "collective", "shared_memory")


@dataclass(frozen=True)
class _Entry:
    """One megatron parameter in the export plan (identical on every rank of the export group)."""

    order: tuple[int, int, int, int]
    stage: int  # the pipeline stage that owns it
    hf_names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    expert_rank: int | None = None  # a routed expert's: the EP rank holding it; None: every EP rank holds it


def export_group() -> dist.ProcessGroup:
    """The group `iter_hf_weights` is collective over: the model-parallel group, or with EP > 1 the group of the EP
    model-parallel groups that share one set of experts."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() > 1:
        return ps.get_expert_tensor_model_pipeline_parallel_group()
    return ps.get_model_parallel_group()


@dataclass(frozen=True)
class _Group:
    """The export group as the export sees it."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int
    tp_rank: int
    tp: int
    tp_group: dist.ProcessGroup
    pp_rank: int
    pp: int
    pp_group: dist.ProcessGroup
    ep_rank: int
    ep: int
    expert_tp_group: dist.ProcessGroup  # shards routed experts; the same ranks as tp_group (expert-TP = TP)

    @classmethod
    def current(cls) -> _Group:
        from megatron.core import parallel_state as ps

        tp_rank, tp, tp_group = tp_layout()
        expert_tp_rank, expert_tp, expert_tp_group = tp_layout(expert=True)
        if (expert_tp_rank, expert_tp) != (tp_rank, tp):
            raise ValueError(f"the exporter needs expert-TP = TP, got expert-TP {expert_tp} and TP {tp}")
        group = export_group()
        return cls(group, tuple(dist.get_process_group_ranks(group)), dist.get_rank(), tp_rank, tp, tp_group,
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_group(), ps.get_expert_model_parallel_rank(),
                   ps.get_expert_model_parallel_world_size(), expert_tp_group)


@dataclass(frozen=True)
class _Exchange:
    """What a full exchange established, the same on every rank of the group."""

    ident: int  # digest of everything gathered
    digests: tuple[int, ...]  # every rank's plan digest, in group order
    plan: tuple[_Entry, ...]  # sorted in HF order
    place: dict[tuple[int, int, int], int]  # (pp_rank, ep_rank, tp_rank) -> global rank
    one_host: bool


# model -> (group ranks, transport) -> the last full exchange this rank took part in for it
_EXCHANGES: weakref.WeakKeyDictionary[object, dict[tuple[tuple[int, ...], str], _Exchange]] = \
    weakref.WeakKeyDictionary()


def _digest(value: object) -> int:
    """A 63-bit digest of repr(value), the same in every process (unlike hash())."""
    return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little") >> 1


def _targets(destinations: Iterable[int] | None, group: _Group) -> tuple[int, ...]:
    if destinations is None:
        return group.ranks
    wanted = set(destinations)
    world = dist.get_world_size()
    bad = [d for d in wanted if not isinstance(d, int) or not 0 <= d < world]
    if bad:
        raise ValueError(f"destinations must be global ranks in [0, {world}), got {sorted(map(str, bad))}")
    return tuple(r for r in group.ranks if r in wanted)


def iter_hf_weights(model_chunks: Sequence[nn.Module], args: HFModelArgs, *, dtype: torch.dtype | None = None,
                    destinations: Iterable[int] | None = None,
                    transport: str = "auto") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` in HF order on every destination rank; other ranks get an empty stream.

    Collective over each export group (`export_group`: the model-parallel group, with EP the EP such groups that
    share one set of experts): every rank must run the generator to its end, destination or not, since the others
    send or write their shards from inside it. `destinations`: global ranks that receive the stream; None means
    every rank (`mppo convert`, checkpoints). A rank serves only the destinations inside its own export group (they
    must be the same on every rank of it), and a group without one does nothing, so the rollout sync passes the
    engine ranks. Tensors are in `dtype` if given, else the parameter dtype.

    `transport`:
    - "collective": TP shards are gathered onto the destinations' TP indices on the owning stage (gather for one
      index, all-gather for several), un-fused there, and sent over PP (one broadcast when every rank of a PP group
      is a destination, point-to-point otherwise); a routed expert's tensors go point-to-point from its EP rank to
      the destinations of the other EP ranks. Any backend, and the path on GPUs (nccl), where the rollout
      transport proper is CUDA IPC into SGLang. Yields fresh tensors, one parameter's worth at a time.
    - "shared_memory": every rank writes its shards, un-fused, straight into each destination's persistent
      shared-memory buffer; the destination yields views of it (mppo.models.weight_transport). gloo on one host only.
      The views are *staged*: the next export of the same model to the same destination overwrites them, so copy
      them (or keep them as an engine's weights, see is_staged) before then.
    - "auto": "shared_memory" for explicit `destinations` on a gloo group whose ranks share a host with /dev/shm,
      else "collective". With every rank a destination (None) it stays collective: staging would hold one model
      copy per rank.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    group = _Group.current()
    targets = _targets(destinations, group)
    if not targets:
        return
    local: dict[tuple[int, int, int, int], tuple[WeightRule, torch.Tensor]] = {}
    mine = []
    for chunk in model_chunks:
        model = unwrap_model(chunk)
        for name, param in export_parameters(model):  # LoRA: adapters merged into their base weights
            rule = weight_rule(model, name)
            if rule is None:
                continue
            local[rule.order] = (rule, param)
            if not rule.expert and group.ep_rank > 0:
                continue  # every EP replica holds it: the plan takes EP rank 0's
            shapes = full_shapes(rule, param.shape, args, group.tp)
            mine.append(_Entry(rule.order, group.pp_rank, rule.hf_names, shapes,
                               str(dtype or param.dtype).removeprefix("torch."),
                               group.ep_rank if rule.expert else None))
    owner = model_chunks[0]  # the key of this model's cached exchange and staging buffers
    exchange, staging_digests = _handshake(group, mine, targets, transport, owner)
    backend = dist.get_backend(group.group)
    can_stage = backend == "gloo" and exchange.one_host and weight_transport.SHM_DIR.is_dir()
    if transport == "shared_memory" and not can_stage:
        raise ValueError(f"transport='shared_memory' needs a gloo group whose ranks share one host with "
                         f"{weight_transport.SHM_DIR}; this group runs {backend}"
                         f"{'' if exchange.one_host else ' on several hosts'}: use transport='collective' or 'auto'")
    if transport == "shared_memory" or (transport == "auto" and destinations is not None and can_stage):
        slots = [weight_transport.Slot(n, s, getattr(torch, e.dtype))
                 for e in exchange.plan for n, s in zip(e.hf_names, e.shapes)]
        buffers = weight_transport.prepare(owner, group.group, group.ranks, targets, slots, staging_digests)
        yield from _staged_export(local, exchange.plan, group, buffers, args)
    else:
        yield from _collective_export(local, exchange, group, targets, args)


def _handshake(group: _Group, mine: list[_Entry], targets: tuple[int, ...], transport: str,
               owner: object) -> tuple[_Exchange, list[int]]:
    """The group's plan and layout: from the last full exchange when every rank still agrees with it, else from a
    new one. Also returns every rank's staging digest (weight_transport.state_digest)."""
    key = (group.ranks, transport)
    digest = _digest((mine, targets, group.pp_rank, group.ep_rank, group.tp_rank))
    cached = _EXCHANGES.get(owner, {}).get(key)
    local = torch.tensor([digest, cached.ident if cached else 0,
                          weight_transport.state_digest(owner, group.ranks, targets)], dtype=torch.int64,
                         device=collective_device(group.group))
    gathered = [torch.empty_like(local) for _ in group.ranks]
    dist.all_gather(gathered, local, group=group.group)
    rows = [row.tolist() for row in gathered]
    digests, idents, staging = (tuple(column) for column in zip(*rows))
    if cached is not None and set(idents) == {cached.ident} and digests == cached.digests:
        return cached, list(staging)

    info = {"plan": mine if group.tp_rank == 0 else [], "place": (group.pp_rank, group.ep_rank, group.tp_rank),
            "host": socket.gethostname(), "targets": targets}
    infos: list = [None] * len(group.ranks)
    dist.all_gather_object(infos, info, group=group.group)
    if len({i["targets"] for i in infos}) > 1:
        raise ValueError("the ranks of a model-parallel group passed different destinations to iter_hf_weights: "
                         f"{[i['targets'] for i in infos]}; pass the same global ranks on all of them")
    exchange = _Exchange(ident=_digest((digests, infos)) or 1, digests=digests,
                         plan=tuple(sorted((e for i in infos for e in i["plan"]), key=lambda e: e.order)),
                         place={i["place"]: r for i, r in zip(infos, group.ranks)},
                         one_host=len({i["host"] for i in infos}) == 1)
    _EXCHANGES.setdefault(owner, {})[key] = exchange
    return exchange, list(staging)


def _staged_export(local, plan: Sequence[_Entry], group: _Group, buffers, args: HFModelArgs):
    """Every rank writes its shards into every destination's buffer; after a barrier the destination yields views."""
    # Plain CPU copies: without the CPU-compat torch-function modes (mppo.parallel.cpu_compat), which would add
    # microseconds of Python to each of the loop's hundreds of tensor calls and only ever rewrite CUDA arguments.
    with torch.no_grad(), torch._C.DisableTorchFunction():
        for rule, param in local.values():
            if not rule.expert and group.ep_rank > 0:
                continue  # the same values as EP rank 0's, which writes them
            if param.device.type != "cpu":
                raise ValueError(f"the shared-memory transport stages CPU tensors; {rule.hf_names[0]} is on "
                                 f"{param.device}: use transport='collective'")
            for buffer in buffers.values():
                place_shard(rule, param.detach(), [buffer.view(n) for n in rule.hf_names], args, group.tp_rank,
                            group.tp)
    dist.barrier(group=group.group)
    if group.rank in buffers:
        for entry in plan:
            for name in entry.hf_names:
                yield name, buffers[group.rank].view(name)


def _collective_export(local, exchange: _Exchange, group: _Group, targets: tuple[int, ...], args: HFModelArgs):
    """TP gather (or all-gather) onto the needed TP indices of the owning stage, un-fuse, send over PP; a routed
    expert's tensors from its EP rank to the destinations of every EP replica."""
    device = next(iter(local.values()))[1].device
    place = exchange.place
    target_tp = sorted({tp_rank for (_, _, tp_rank), r in place.items() if r in targets})
    pp_ranks = dist.get_process_group_ranks(group.pp_group)
    pp_all_targets = all(r in targets for r in pp_ranks)  # then one broadcast reaches all of them
    for entry in exchange.plan:
        out_dtype = getattr(torch, entry.dtype)
        # dense weights: each EP replica serves its own destinations; experts: the EP rank that holds them
        owner_ep = group.ep_rank if entry.expert_rank is None else entry.expert_rank
        full = None
        if (group.pp_rank, group.ep_rank) == (entry.stage, owner_ep):
            rule, param = local[entry.order]
            full = _gather_and_unfuse(rule, param, entry, group, target_tp, place, out_dtype, device, args)
        if group.tp_rank in target_tp and (group.pp > 1 or entry.expert_rank is not None):
            src = place[entry.stage, owner_ep, group.tp_rank]
            if entry.expert_rank is None:  # within this EP replica: its PP group
                receivers = [r for r in pp_ranks if r in targets and r != src]
                broadcast = pp_all_targets
            else:  # the same TP index of every stage and EP rank
                receivers = [r for (_, _, tp_rank), r in sorted(place.items())
                             if tp_rank == group.tp_rank and r in targets and r != src]
                broadcast = False
            if full is None and group.rank in receivers:
                full = [torch.empty(shape, dtype=out_dtype, device=device) for shape in entry.shapes]
            for tensor in full if (group.rank == src or group.rank in receivers) else []:
                if broadcast:
                    dist.broadcast(tensor, src=src, group=group.pp_group)
                elif group.rank == src:
                    for receiver in receivers:
                        dist.send(tensor, dst=receiver)
                else:
                    dist.recv(tensor, src=src)
        if group.rank in targets:
            yield from zip(entry.hf_names, full)


def _gather_and_unfuse(rule, param, entry: _Entry, group: _Group, target_tp: list[int], place, out_dtype, device,
                       args: HFModelArgs) -> list[torch.Tensor] | None:
    """On the owning ranks: the full HF tensors of one parameter on the target TP indices (None elsewhere)."""
    tp_group = group.expert_tp_group if rule.expert else group.tp_group
    shard = param.detach().contiguous()
    if group.tp == 1:
        shards = [shard]
    elif len(target_tp) == 1:
        root = place[entry.stage, group.ep_rank, target_tp[0]]
        shards = [torch.empty_like(shard) for _ in range(group.tp)] if group.rank == root else None
        dist.gather(shard, shards, dst=root, group=tp_group)
    else:
        shards = [torch.empty_like(shard) for _ in range(group.tp)]
        dist.all_gather(shards, shard, group=tp_group)
    if group.tp_rank not in target_tp:
        return None
    full = [torch.empty(shape, dtype=out_dtype, device=device) for shape in entry.shapes]
    with torch.no_grad():
        for tp_rank, part in enumerate(shards):
            place_shard(rule, part, full, args, tp_rank, group.tp)
    return full


__all__ = ["TRANSPORTS", "export_group", "iter_hf_weights"]
