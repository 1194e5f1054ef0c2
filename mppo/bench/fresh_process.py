"""One benchmark case per fresh Python process, for the benchmarks that measure peak memory (`mppo bench kernels`,
`mppo bench attention`): allocator caches and high-water marks never leak from one case into the next.

The benchmark module runs itself as the worker (`python -m MODULE --worker ...`), measures one case and prints
its result as JSON on the last stdout line; `run_case` launches it and reads that line back. `run_torchrun` is the
same for a case of several ranks (`mppo bench step`, `off-policy`, `long-context`): one fresh torchrun launch.
"""
from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A worker is a world of one: torchrun's variables (when the benchmark itself runs under torchrun) must not leak in.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")


def run_case(module: str, worker_args: list[str], *, case: dict, timeout: float, threads: int | None = None,
             hide_gpus: bool = False) -> dict:
    """The result dict of `python -m module --worker *worker_args` in a fresh process, or `case` with an "error"
    (time-out, non-zero exit). `threads` sets OMP_NUM_THREADS; `hide_gpus` runs the case on the CPU."""
    cmd = [sys.executable, "-m", module, "--worker", *worker_args]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**case, "error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"(no output; killed by signal {-proc.returncode}?)"])[-1]
        return {**case, "error": f"exit {proc.returncode}: {last[:120]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_torchrun(module: str, args: list[str], *, nproc: int, threads: int, timeout_s: float,
                 device: str = "cpu", expect: Path | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc -m module *args` on a free local port, `threads` OpenMP threads per rank,
    the GPUs hidden unless `device` is cuda. A non-zero exit (or `expect` not written) is a RuntimeError carrying
    the command and the tails of its output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={port}", "-m", module, *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or (expect is not None and not expect.is_file()):
        raise RuntimeError(f"benchmark ranks failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def peak_rss_bytes() -> int:
    """This process's peak resident set size (the kernel's high-water mark; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_results(path: str | None, results: list[dict]) -> None:
    """Every case's raw result as JSON (the benchmarks' `--json`), when a path is given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
