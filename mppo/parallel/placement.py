"""Separate placement (`actor_rollout_ref.hybrid_engine=false`): trainer ranks and engine ranks under one torchrun.

Co-located (the default), every rank trains and generates. Separate, each rank of the launch is either a trainer
rank or an engine rank (veRL fully_async's pools: `trainer.nnodes` x `trainer.n_gpus_per_node` trainer ranks,
`actor_rollout_ref.rollout.nnodes` x `rollout.n_gpus_per_node` engine ranks), in one of two shapes:

    shared nodes   trainer.nnodes = rollout.nnodes = the launch's nodes, nproc_per_node = trainer's + rollout's:
                   on every node the first trainer.n_gpus_per_node local ranks train, the others generate
    own nodes      nproc_per_node = trainer.n_gpus_per_node = rollout.n_gpus_per_node: the first trainer.nnodes
                   nodes train, the other rollout.nnodes nodes generate

Why each side gets its own default process group: megatron's initialize_model_parallel, dist_checkpointing and
the trainer's checkpoint barriers are collective over the *default* group (new_group included), so building the
trainer's TP/PP/DP/EP over a subset of one world would mean every engine rank joining every trainer collective.
Instead `init_placement` rendezvouses once through torchrun's store and gives the trainer ranks a default group of
their own (megatron then lays out TP/PP/DP/EP over exactly them, unchanged) and the engine ranks another (the rollout
factory forms engine groups over it). What crosses the split goes over a `Bridge`: process groups over every rank
of the launch made directly on the same store (gloo for control messages and results; gloo or NCCL for weights),
driven only through their own methods, so torch.distributed's default-group bookkeeping never sees them.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mppo.errors import UserError

TRAINER, ENGINE = "trainer", "engine"


class PlacementError(UserError, ValueError):
    """The launch's ranks do not split into the configured trainer and engine pools."""


@dataclass(frozen=True)
class Placement:
    """Which global ranks of the launch train and which generate (the same on every rank)."""

    trainer_ranks: tuple[int, ...]
    engine_ranks: tuple[int, ...]
    engines_per_node: int  # engine ranks on each node that has any (the rollout factory's "local world")

    def role(self, rank: int) -> str:
        return TRAINER if rank in self.trainer_ranks else ENGINE

    def side_rank(self, rank: int) -> int:
        """This rank's rank within its side's own world (its default process group)."""
        ranks = self.trainer_ranks if self.role(rank) == TRAINER else self.engine_ranks
        return ranks.index(rank)


def plan_placement(world: int, local_world: int, *, trainer_nnodes: int, trainer_per_node: int,
                   rollout_nnodes: int, rollout_per_node: int) -> Placement:
    """The split of a launch of `world` ranks, `local_world` per node (torchrun numbers ranks node by node)."""
    keys = ("trainer.nnodes x trainer.n_gpus_per_node + actor_rollout_ref.rollout.nnodes x "
            "actor_rollout_ref.rollout.n_gpus_per_node")
    for key, value in (("trainer.nnodes", trainer_nnodes), ("trainer.n_gpus_per_node", trainer_per_node),
                       ("actor_rollout_ref.rollout.nnodes", rollout_nnodes),
                       ("actor_rollout_ref.rollout.n_gpus_per_node", rollout_per_node)):
        if value < 1:
            raise PlacementError(f"{key} = {value}: actor_rollout_ref.hybrid_engine=false needs at least 1; set it")
    planned = trainer_nnodes * trainer_per_node + rollout_nnodes * rollout_per_node
    if planned != world:
        raise PlacementError(f"{keys} = {trainer_nnodes} x {trainer_per_node} + {rollout_nnodes} x "
                             f"{rollout_per_node} = {planned}, but the launch has {world} ranks (WORLD_SIZE); make "
                             "them match (actor_rollout_ref.hybrid_engine=false splits the launch into the two)")
    if world % local_world:
        raise PlacementError(f"the launch has {world} ranks but {local_world} per node (LOCAL_WORLD_SIZE)")
    nnodes = world // local_world
    if trainer_nnodes == rollout_nnodes == nnodes and local_world == trainer_per_node + rollout_per_node:
        per_node = [(node * local_world, node * local_world + trainer_per_node) for node in range(nnodes)]
        trainer = tuple(r for first, split in per_node for r in range(first, split))
        engine = tuple(r for first, split in per_node for r in range(split, first + local_world))
    elif local_world == trainer_per_node == rollout_per_node and trainer_nnodes + rollout_nnodes == nnodes:
        split = trainer_nnodes * local_world
        trainer, engine = tuple(range(split)), tuple(range(split, world))
    else:
        raise PlacementError(
            f"{nnodes} node(s) of {local_world} ranks do not split into trainer.nnodes={trainer_nnodes} x "
            f"trainer.n_gpus_per_node={trainer_per_node} and actor_rollout_ref.rollout.nnodes={rollout_nnodes} x "
            f"rollout.n_gpus_per_node={rollout_per_node}: either share every node (both nnodes = {nnodes}, the two "
            f"n_gpus_per_node summing to {local_world}) or give each side whole nodes (both n_gpus_per_node = "
            f"{local_world}, the two nnodes summing to {nnodes})")
    return Placement(trainer_ranks=trainer, engine_ranks=engine, engines_per_node=rollout_per_node)


# ---------------------------------------------------------------------------------------------------- the bridge
class Bridge:
    """Process groups over the ranks of the launch, across the split. `src` arguments are global ranks.

    `control`: gloo over every rank of the launch, for the trainer's small messages (torch.save, read back with
    weights_only); `answers`: the same ranks, for the engines' rollout results (a group of its own, so the engines
    can answer one request while the next ones and the weights arrive: mppo.rollout.remote);
    `weight_control` (gloo) and `weights` (gloo on CPU, NCCL on GPUs): over the first trainer rank and the engine
    ranks (`weight_ranks`), for bucket layouts and the bytes of the weight stream. `device`: where the weight
    stream's tensors live on this rank. Ranks outside the weight ranks hold None for those two."""

    def __init__(self, control: Any, answers: Any, weight_control: Any | None, weights: Any | None,
                 weight_ranks: tuple[int, ...], rank: int, world: int, device: torch.device) -> None:
        self.control, self.answers, self.weight_control, self.weights = control, answers, weight_control, weights
        self.weight_ranks, self.rank, self.world, self.device = weight_ranks, rank, world, device

    def broadcast_object(self, obj: Any, src: int, *, weights: bool = False, answers: bool = False) -> Any:
        """`obj` of global rank `src` on every rank of the group (control; with `answers` the answers group, with
        `weights` the weight ranks): one length and one payload broadcast."""
        if weights:
            group, root = self.weight_control, self.weight_ranks.index(src)
        else:
            group, root = (self.answers if answers else self.control), src
        payload = None
        if self.rank == src:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        length = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
        _broadcast(group, length, root)
        if payload is None:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        _broadcast(group, payload, root)
        if self.rank == src:
            return obj
        # weights_only: a peer's message is tensors and plain containers; nothing in it may name code to run
        return torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu", weights_only=True)

    def broadcast_weights(self, tensor: torch.Tensor) -> None:
        """The first trainer rank's `tensor` into every engine rank's (in place, on `device`)."""
        _broadcast(self.weights, tensor, 0)

    def shutdown(self) -> None:
        for group in (self.weights, self.weight_control, self.answers, self.control):
            if group is not None and hasattr(group, "shutdown"):
                group.shutdown()


def _broadcast(group: Any, tensor: torch.Tensor, root: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    group.broadcast([tensor], options).wait()


@dataclass(frozen=True)
class Side:
    """What init_placement made on this rank."""

    role: str  # TRAINER or ENGINE
    placement: Placement
    bridge: Bridge


def init_placement(placement: Placement, *, timeout_s: float) -> Side:
    """Rendezvous through torchrun's store, give this rank's side its own default process group (nccl with CUDA,
    else gloo), and build the bridge. Collective over every rank of the launch; call it before
    mppo.parallel.init_distributed, which then builds megatron's layout over this side's default group."""
    if dist.is_initialized():
        raise RuntimeError("init_placement() must come before torch.distributed is initialised")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)))
    role = placement.role(rank)
    ranks = placement.trainer_ranks if role == TRAINER else placement.engine_ranks
    timeout = timedelta(seconds=timeout_s)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"mppo/{role}", store),
                            rank=ranks.index(rank), world_size=len(ranks), timeout=timeout,
                            device_id=device if cuda else None)
    control = dist.ProcessGroupGloo(dist.PrefixStore("mppo/bridge/control", store), rank, world, timeout)
    answers = dist.ProcessGroupGloo(dist.PrefixStore("mppo/bridge/answers", store), rank, world, timeout)
    weight_ranks = (placement.trainer_ranks[0], *placement.engine_ranks)
    weight_control = weights = None
    if rank in weight_ranks:
        index, size = weight_ranks.index(rank), len(weight_ranks)
        weight_control = dist.ProcessGroupGloo(dist.PrefixStore("mppo/bridge/weight_control", store), index, size,
                                               timeout)
        weights = weight_control
        if cuda:  # the bytes over NCCL, GPU to GPU
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            weights = dist.ProcessGroupNCCL(dist.PrefixStore("mppo/bridge/weights", store), index, size, options)
    return Side(role, placement, Bridge(control, answers, weight_control, weights, weight_ranks, rank, world, device))


__all__ = ["ENGINE", "TRAINER", "Bridge", "Placement", "PlacementError", "Side", "init_placement",
           "plan_placement"]
