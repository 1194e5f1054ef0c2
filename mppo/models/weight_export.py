"""Megatron -> HF export: full HF tensors for the destination ranks, by collectives or by shared-memory staging.

Every rank of an export group runs `iter_hf_weights` to its end; the destinations get `(hf_name, tensor)` pairs in
HF order, the other ranks an empty stream. The export group is the model-parallel group (the TP x PP ranks of one
DP replica); when one set of experts spans more ranks than a TP group (EP > 1 or expert-TP > TP) it is megatron's
expert-tensor-model-pipeline group, the expert-TP x EP x PP ranks that hold every expert once and whole dense
replicas (EP of them with expert-TP = TP; one at TP 2 x EP 2 with expert-TP 1): each dense replica serves its dense
weights itself, a routed expert's weights come from the EP rank that holds them, gathered over expert-TP. The
layout mapping is
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
    expert_rank: int | None = None  # a routed expert's: the EP rank holding it; None: every dense replica holds it


def _expert_block() -> int:
    """Ranks of a pipeline stage that hold one set of experts: expert-TP x EP (a multiple of TP, which
    mppo.parallel.state.check_layout ensures)."""
    from megatron.core import parallel_state as ps

    return ps.get_expert_tensor_parallel_world_size() * ps.get_expert_model_parallel_world_size()


def export_group() -> dist.ProcessGroup:
    """The group `iter_hf_weights` is collective over: the model-parallel group, or when one set of experts spans
    more ranks than a TP group (EP > 1, or expert-TP > TP) megatron's expert-tensor-model-pipeline group, which
    holds whole model-parallel groups (dense replicas) and every expert once."""
    from megatron.core import parallel_state as ps

    if _expert_block() > ps.get_tensor_model_parallel_world_size():
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
    replica: int  # which of the group's model-parallel groups (dense replicas) this rank is in
    ep_rank: int
    ep: int
    etp_rank: int
    etp: int
    expert_tp_group: dist.ProcessGroup  # shards routed experts (the TP group's ranks when expert-TP = TP)

    @classmethod
    def current(cls) -> _Group:
        from megatron.core import parallel_state as ps

        tp_rank, tp, tp_group = tp_layout()
        etp_rank, etp, expert_tp_group = tp_layout(expert=True)
        group = export_group()
        # the group's ranks of a stage are consecutive (megatron's order: TP fastest, then DP), so its dense
        # replicas are consecutive DP ranks
        replicas = max(1, _expert_block() // tp)
        return cls(group, tuple(dist.get_process_group_ranks(group)), dist.get_rank(), tp_rank, tp, tp_group,
                   ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size(),
                   ps.get_pipeline_model_parallel_group(), ps.get_data_parallel_rank() % replicas,
                   ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(), etp_rank, etp,
                   expert_tp_group)

    def shard_of(self, rule: WeightRule) -> tuple[int, int]:
        """(index, count) of this rank's shard of a parameter: over expert-TP for a routed expert, else over TP."""
        return (self.etp_rank, self.etp) if rule.expert else (self.tp_rank, self.tp)

    def holds_plan_copy(self, rule: WeightRule) -> bool:
        """Whether this rank's copy of the parameter goes into the plan: each routed expert lives once in the group,
        a dense weight once per replica (the plan takes replica 0's)."""
        return rule.expert or self.replica == 0


@dataclass(frozen=True)
class _Exchange:
    """What a full exchange established, the same on every rank of the group."""

    ident: int  # digest of everything gathered
    digests: tuple[int, ...]  # every rank's plan digest, in group order
    plan: tuple[_Entry, ...]  # sorted in HF order
    place: dict[tuple[int, int, int], int]  # dense weights' places: (pp_rank, replica, tp_rank) -> global rank
    expert_place: dict[tuple[int, int, int], int]  # routed experts': (pp_rank, ep_rank, expert-TP rank) -> rank
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
            if not group.holds_plan_copy(rule):
                continue
            shapes = full_shapes(rule, param.shape, args, group.shard_of(rule)[1])
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
    digest = _digest((mine, targets, group.pp_rank, group.replica, group.tp_rank, group.ep_rank, group.etp_rank))
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

    first_shard = [e for e in mine if (group.tp_rank if e.expert_rank is None else group.etp_rank) == 0]
    info = {"plan": first_shard,
            "place": (group.pp_rank, group.replica, group.tp_rank),
            "expert_place": (group.pp_rank, group.ep_rank, group.etp_rank),
            "host": socket.gethostname(), "targets": targets}
    infos: list = [None] * len(group.ranks)
    dist.all_gather_object(infos, info, group=group.group)
    if len({i["targets"] for i in infos}) > 1:
        raise ValueError("the ranks of a model-parallel group passed different destinations to iter_hf_weights: "
                         f"{[i['targets'] for i in infos]}; pass the same global ranks on all of them")
    exchange = _Exchange(ident=_digest((digests, infos)) or 1, digests=digests,
                         plan=tuple(sorted((e for i in infos for e in i["plan"]), key=lambda e: e.order)),
                         place={i["place"]: r for i, r in zip(infos, group.ranks)},
                         expert_place={i["expert_place"]: r for i, r in zip(infos, group.ranks)},
                         one_host=len({i["host"] for i in infos}) == 1)
    _EXCHANGES.setdefault(owner, {})[key] = exchange
    return exchange, list(staging)


def _staged_export(local, plan: Sequence[_Entry], group: _Group, buffers, args: HFModelArgs):
    """Every rank writes its shards into every destination's buffer; after a barrier the destination yields views."""
    # Plain CPU copies: without the CPU-compat torch-function modes (mppo.parallel.cpu_compat), which would add
    # microseconds of Python to each of the loop's hundreds of tensor calls and only ever rewrite CUDA arguments.
    with torch.no_grad(), torch._C.DisableTorchFunction():
        for rule, param in local.values():
            if not group.holds_plan_copy(rule):
                continue  # the same values as replica 0's, which writes them
            if param.device.type != "cpu":
                raise ValueError(f"the shared-memory transport stages CPU tensors; {rule.hf_names[0]} is on "
                                 f"{param.device}: use transport='collective'")
            for buffer in buffers.values():
                place_shard(rule, param.detach(), [buffer.view(n) for n in rule.hf_names], args,
                            *group.shard_of(rule))
    dist.barrier(group=group.group)
    if group.rank in buffers:
        for entry in plan:
            for name in entry.hf_names:
                yield name, buffers[group.rank].view(name)


def _collective_export(local, exchange: _Exchange, group: _Group, targets: tuple[int, ...], args: HFModelArgs):
    """A dense weight: TP gather (or all-gather) onto the destinations' TP indices of the owning stage in each
    replica, un-fuse, send over that replica's PP group. A routed expert: gather over expert-TP onto the
    destinations' expert-TP indices of the EP rank holding it, un-fuse, send to the destinations of that index."""
    device = next(iter(local.values()))[1].device
    dense, experts = exchange.place, exchange.expert_place
    target_tp = sorted({tp_rank for (_, _, tp_rank), r in dense.items() if r in targets})
    target_etp = sorted({etp_rank for (_, _, etp_rank), r in experts.items() if r in targets})
    pp_ranks = dist.get_process_group_ranks(group.pp_group)
    pp_all_targets = all(r in targets for r in pp_ranks)  # then one broadcast reaches all of them
    for entry in exchange.plan:
        out_dtype = getattr(torch, entry.dtype)
        expert = entry.expert_rank is not None
        full = None
        if (group.pp_rank, group.ep_rank if expert else group.replica) == \
                (entry.stage, entry.expert_rank if expert else group.replica):
            rule, param = local[entry.order]
            indices, places = ((target_etp, experts) if expert else (target_tp, dense))
            full = _gather_and_unfuse(rule, param, entry, group, indices, places, out_dtype, device, args)
        my_index = group.etp_rank if expert else group.tp_rank
        if my_index in (target_etp if expert else target_tp) and (group.pp > 1 or expert):
            if not expert:  # within this replica: its PP group
                src = dense[entry.stage, group.replica, group.tp_rank]
                receivers = [r for r in pp_ranks if r in targets and r != src]
                broadcast = pp_all_targets
            else:  # every destination with the same expert-TP index
                src = experts[entry.stage, entry.expert_rank, group.etp_rank]
                receivers = [r for (_, _, etp_rank), r in sorted(experts.items())
                             if etp_rank == group.etp_rank and r in targets and r != src]
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


def _gather_and_unfuse(rule, param, entry: _Entry, group: _Group, target_index: list[int], place, out_dtype, device,
                       args: HFModelArgs) -> list[torch.Tensor] | None:
    """On the owning ranks: the full HF tensors of one parameter on the target shard indices (TP, or expert-TP
    for a routed expert; None elsewhere). `place` maps (stage, replica or EP rank, index) to global ranks."""
    index, count = group.shard_of(rule)
    shard_group = group.expert_tp_group if rule.expert else group.tp_group
    owner = group.ep_rank if rule.expert else group.replica
    shard = param.detach().contiguous()
    if count == 1:
        shards = [shard]
    elif len(target_index) == 1:
        root = place[entry.stage, owner, target_index[0]]
        shards = [torch.empty_like(shard) for _ in range(count)] if group.rank == root else None
        dist.gather(shard, shards, dst=root, group=shard_group)
    else:
        shards = [torch.empty_like(shard) for _ in range(count)]
        dist.all_gather(shards, shard, group=shard_group)
    if index not in target_index:
        return None
    full = [torch.empty(shape, dtype=out_dtype, device=device) for shape in entry.shapes]
    with torch.no_grad():
        for shard_index, part in enumerate(shards):
            place_shard(rule, part, full, args, shard_index, count)
    return full


__all__ = ["TRANSPORTS", "export_group", "iter_hf_weights"]
