"""Process groups: torch.distributed from the torchrun environment, then megatron's parallel_state.

Every rank runs the same program (SPMD). The layout is TP x CP x DP x PP with DP = world / (TP x CP x PP), in
megatron's default rank order (tp-cp-ep-dp-pp: TP fastest, then CP, then DP, then PP). Context parallelism (CP)
splits each sequence over CP ranks that hold the same rows (one data shard per DP rank, as megatron: its
data-parallel rank leaves CP out, and DDP reduces gradients over DP x CP). Expert parallelism (EP, MoE models)
splits each MoE layer's experts over EP ranks: the experts' layout is expert-TP x EP x expert-DP x PP over the same
ranks, megatron's expert-tensor, expert-model-parallel and expert-data-parallel groups. With expert-TP = TP (the
default) the EP ranks come from the DP dimension (expert-DP = DP / EP); with expert-TP 1 at TP 2 and EP 2 the
experts are whole and split over the two TP ranks, while attention stays TP-sharded. EP with CP > 1 is refused.
Without a torchrun
environment the process runs alone as a world of one, which is what `mppo convert` and small scripts use.
"""
from __future__ import annotations

import gc
import logging
import os
import random
import socket
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from mppo.errors import UserError
from mppo.parallel import cpu_compat

log = logging.getLogger(__name__)


class ParallelLayoutError(UserError, ValueError):
    """The requested TP/PP/VPP layout does not fit the world size or the model."""


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout and this rank's place in it."""

    tp: int
    pp: int
    vpp: int | None  # virtual pipeline chunks per PP rank; None means no interleaving
    dp: int
    world: int
    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    backend: str  # "nccl" or "gloo"
    device: torch.device  # where this rank's tensors live
    ep: int = 1  # expert parallel size: ranks sharing one MoE layer's experts
    ep_rank: int = 0
    etp: int | None = None  # expert tensor parallel size: ranks sharding each routed expert; None: tp
    etp_rank: int = 0
    cp: int = 1  # context parallel size: ranks splitting each sequence (2 x cp load-balanced chunks)
    cp_rank: int = 0

    @property
    def expert_tp(self) -> int:
        """Ranks sharding each routed expert: `etp`, or TP (megatron's default)."""
        return self.etp or self.tp

    @property
    def expert_dp(self) -> int:
        """Data-parallel replicas of each expert: TP x DP / (expert-TP x EP), DP / EP when expert-TP = TP."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    @property
    def num_model_chunks(self) -> int:
        return self.vpp or 1

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world} on {socket.gethostname()} ({self.backend}, {self.device}): "
                f"tp {self.tp_rank}/{self.tp} pp {self.pp_rank}/{self.pp} dp {self.dp_rank}/{self.dp}"
                + (f" vpp {self.vpp}" if self.vpp else "")
                + (f" ep {self.ep_rank}/{self.ep}" if self.ep > 1 else "")
                + (f" etp {self.etp_rank}/{self.expert_tp}" if self.expert_tp != self.tp else "")
                + (f" cp {self.cp_rank}/{self.cp}" if self.cp > 1 else "")
                # torchrun's node (group) and local rank: which node a rank is on when hostnames repeat
                + f" node {os.environ.get('GROUP_RANK', '0')} local {os.environ.get('LOCAL_RANK', '0')}")


_dims: ParallelDims | None = None


def check_layout(world: int, tp: int, pp: int, vpp: int | None = None, ep: int = 1, etp: int | None = None,
                 cp: int = 1) -> int:
    """Validate a layout against a world size and return DP; raises ParallelLayoutError with the fix."""
    if tp < 1 or pp < 1 or ep < 1 or cp < 1 or (etp is not None and etp < 1):
        raise ParallelLayoutError(f"tp, pp, ep, etp and cp must be >= 1, got tp={tp} pp={pp} ep={ep} etp={etp} "
                                  f"cp={cp}")
    model = tp * pp * cp
    if world % model != 0:
        what = f"tp*pp = {tp}*{pp}" if cp == 1 else f"tp*pp*cp = {tp}*{pp}*{cp}"
        raise ParallelLayoutError(
            f"world size {world} is not divisible by {what} = {model}; launch a multiple of "
            f"{model} processes (torchrun --nproc_per_node ...) or change tp/pp{'/cp' if cp > 1 else ''}")
    if vpp is not None and vpp > 1 and pp < 2:
        raise ParallelLayoutError(f"virtual pipeline (vpp={vpp}) needs pp >= 2, got pp={pp}; drop vpp or raise pp")
    if ep > 1 and cp > 1:  # megatron takes EP ranks from DP x CP; mppo's MoE paths (R3, aux losses) are not CP-aware
        raise ParallelLayoutError(f"expert parallelism (ep={ep}) with context parallelism (cp={cp}) is not "
                                  "supported; use cp=1 for MoE models or ep=1")
    dp = world // model
    if etp not in (None, tp):
        return _check_expert_layout(world, tp, pp, ep, etp, dp)
    if dp % ep != 0:  # megatron: world % (expert-TP x EP x PP) with expert-TP = TP
        raise ParallelLayoutError(
            f"ep={ep} does not divide the data-parallel size {dp} (world {world} / (tp*pp = {tp * pp})): the experts "
            f"are split over EP ranks taken from the data-parallel ones; pick ep from the divisors of {dp} or launch "
            f"a multiple of {tp * pp * ep} processes")
    return dp


def _check_expert_layout(world: int, tp: int, pp: int, ep: int, etp: int, dp: int) -> int:
    """An expert-TP other than TP: megatron lays the experts out as expert-TP x EP x expert-DP x PP over the same
    ranks, and mppo's HF export needs each expert-TP x EP block of ranks to hold whole TP groups."""
    block = etp * ep
    if (world // pp) % block:
        raise ParallelLayoutError(
            f"etp x ep = {etp} x {ep} = {block} does not divide the {world // pp} ranks of a pipeline stage (world "
            f"{world} / pp {pp}); pick etp and ep whose product divides {world // pp}")
    if block % tp:
        raise ParallelLayoutError(
            f"etp x ep = {etp} x {ep} = {block} is not a multiple of tp={tp}: each block of ranks holding one set of "
            f"experts must hold whole TP groups (mppo's HF export); raise ep to a multiple of {tp // etp or 1}, or "
            "leave etp = tp")
    return dp


def _env_world() -> tuple[int, int, int]:
    """(rank, world, local_rank) from torchrun's environment, or a world of one without it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0


def init_distributed(tp: int = 1, pp: int = 1, vpp: int | None = None, *, ep: int = 1, etp: int | None = None,
                     cp: int = 1, timeout_s: float = 1800.0, seed: int | None = 1234) -> ParallelDims:
    """Start torch.distributed (once per process) and build megatron's TP/CP/PP/DP groups (and with `ep` > 1 the
    expert-model-parallel and expert-data-parallel groups; `etp`: the expert-tensor-parallel size, None = tp).

    nccl with CUDA, gloo (plus the megatron CPU compatibility layer) without it. Calling it again after
    `destroy()` builds a new layout on the same process group. `seed` seeds Python, torch and megatron's
    model-parallel RNG tracker (`seed_everything`), which building a model needs on GPU and attention needs
    on every forward; pass None only to seed later yourself.
    """
    global _dims
    vpp = None if vpp in (None, 1) else vpp
    etp = None if etp == tp else etp
    rank, world, local_rank = _env_world()
    if dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    dp = check_layout(world, tp, pp, vpp, ep, etp, cp)  # before any group is made (and before megatron's slow import)

    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("megatron parallel state is already initialised; call mppo.parallel.destroy() first")

    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    cpu_compat.install()  # the CUDA patches without CUDA; the Transformer Engine one wherever TE is missing

    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
        else:  # a lone process: an in-memory store is all a world of one needs
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        context_parallel_size=cp,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)))
    _dims = ParallelDims(
        tp=tp, pp=pp, vpp=vpp, dp=dp, world=world, rank=rank,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(), backend=backend, device=device,
        ep=ep, ep_rank=parallel_state.get_expert_model_parallel_rank(), etp=etp,
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        cp=cp, cp_rank=parallel_state.get_context_parallel_rank())
    log.info("parallel layout: %s", _dims.describe())
    if seed is not None:
        seed_everything(seed)
    return _dims


def collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a collective's tensors must live: the current GPU for nccl groups, else the CPU (gloo, or no group)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_dims() -> ParallelDims:
    """The layout set by the last `init_distributed`."""
    if _dims is None:
        raise RuntimeError("mppo.parallel.init_distributed() has not been called")
    return _dims


def seed_everything(seed: int) -> None:
    """Seed like Megatron-LM: a different stream per PP stage; TP ranks share the default stream and get
    their own model-parallel stream from megatron's RNG tracker (model_parallel_cuda_manual_seed)."""
    from megatron.core import tensor_parallel

    stage_seed = seed + 100 * get_dims().pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)  # on CPU this generator is also the one the RNG tracker forks from
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def destroy(*, process_group: bool = False) -> None:
    """Tear down megatron's groups (tests switch layouts this way); with process_group also torch.distributed.

    megatron's destroy_model_parallel only forgets its groups, and a gloo group keeps its threads (a run loop per
    worker, a TCP loop, all waking to poll) for as long as anything references it: a 4-rank test launch that
    switched layouts ~100 times ran ~1300 threads per rank and spent more time in the kernel than computing. So the
    groups megatron created are destroyed here, and the models built on them, once unreferenced, are collected
    (they hold the groups through reference cycles), which frees the groups and their threads."""
    global _dims
    from megatron.core import parallel_state

    groups = [g for g in parallel_state._global_process_group_list or () if g is not None]
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        for group in groups:
            if group in dist.distributed_c10d._world.pg_map:
                dist.destroy_process_group(group)
    gc.collect()
    _dims = None
    if process_group and dist.is_initialized():
        dist.destroy_process_group()
