"""How the SPMD ranks share work: DP slices of the prompt batch, and the model-parallel group's leader.

Every rank has every response (mppo.rollout.factory gathers them) and builds its DP rows itself; within one
model-parallel group (the TP×PP ranks holding one model replica) only the leader (tp_rank 0, pp_rank 0) scores them
and broadcasts the scores to the rest of its group, so every rank then runs the same log-prob and update passes on
the same rows.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from mppo.data.loader import PromptBatch
from mppo.parallel import ParallelDims


class ModelParallelIO:
    def __init__(self, dims: ParallelDims) -> None:
        self.dims = dims
        self.distributed = dist.is_initialized() and dims.world > 1
        self.is_leader = dims.tp_rank == 0 and dims.pp_rank == 0
        self.mp_group = self.dp_group = None
        self.leader_rank = dims.rank
        if self.distributed:
            from megatron.core import parallel_state

            self.mp_group = parallel_state.get_model_parallel_group()
            self.dp_group = parallel_state.get_data_parallel_group()
            self.leader_rank = min(dist.get_process_group_ranks(self.mp_group))

    def dp_slice(self, prompts: PromptBatch) -> tuple[PromptBatch, int]:
        """This DP rank's contiguous share of the global prompt batch, and its offset in it."""
        total, dp = len(prompts), self.dims.dp
        if total % dp:
            raise ValueError(f"{total} prompts do not split over {dp} data-parallel ranks")
        size = total // dp
        start = self.dims.dp_rank * size
        return prompts[start:start + size], start

    def broadcast_from_leader(self, obj: Any) -> Any:
        if self.mp_group is None or dist.get_world_size(self.mp_group) == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader_rank, group=self.mp_group)
        return box[0]
