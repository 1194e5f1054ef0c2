"""Measured numbers of the GPU tier, kept as JSON for the device-check script to collect."""
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
