"""Measured numbers of the GPU tier, kept as JSON for the device-check script to collect, and how peak memory is
measured."""
from __future__ import annotations

import json
import os
from pathlib import Path


def report(name: str, data: dict) -> None:
    """Print `data` and, with MPPO_GPU_REPORT_DIR set, write it to MPPO_GPU_REPORT_DIR/<name>.json."""
    out = os.environ.get("MPPO_GPU_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    print(json.dumps(data, default=str))


def peak_mib(fn) -> float:
    """Peak CUDA memory allocated while `fn()` runs, beyond what was allocated before, in MiB."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
