"""Process groups (nccl|gloo), megatron parallel_state, and the CPU compatibility layer for megatron-core."""
from __future__ import annotations

from mppo.parallel.state import (ParallelDims, ParallelLayoutError, check_layout, collective_device, destroy,
                                 get_dims, init_distributed, seed_everything)

__all__ = ["ParallelDims", "ParallelLayoutError", "check_layout", "collective_device", "destroy", "get_dims", "init_distributed",
           "seed_everything"]
