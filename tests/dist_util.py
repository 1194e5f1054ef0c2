"""Run a test script under torchrun and collect what each rank reports.

Distributed tests pay ~6 s of megatron import per process, so one torchrun launch should check many cases:
the script runs them all and writes one JSON file per rank; the pytest side asserts on those results.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | Path, nproc: int, out_dir: Path, args: list[str] | None = None,
                 timeout: float = 600, env: dict | None = None) -> list[dict]:
    """Launch `script` on `nproc` local ranks; return the JSON each rank wrote to out_dir/rank{R}.json.

    The script receives `--out DIR` as its first argument. On failure the combined output is in the assertion.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), "--out", str(out_dir),
           *(args or [])]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-8000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
