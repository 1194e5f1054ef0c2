"""Run a test script under torchrun and collect what each rank reports (`run_torchrun`, the pytest side), and the
rank side of such a script (`rank_main`).

Distributed tests pay ~6 s of megatron import per process, so one torchrun launch should check many cases:
the script runs them all and writes one JSON file per rank; the pytest side asserts on those results.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Callable

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


def run_cases(script: str | Path, nproc: int, out_dir: Path, **kwargs) -> list[dict]:
    """run_torchrun for a script built on `rank_main`: every rank's results, failing on a rank's crash traceback."""
    results = run_torchrun(script, nproc, out_dir, **kwargs)
    for r in results:
        assert "crash" not in r, r["crash"]
    return results


def on_every_rank(ranks: list[dict], key: str) -> list:
    """`key`'s value on every rank, failing with the ranks that did not report it."""
    missing = [i for i, r in enumerate(ranks) if key not in r]
    assert not missing, f"{key} missing on ranks {missing}"
    return [r[key] for r in ranks]


def rank_main(run: Callable[[argparse.Namespace, dict], None], *,
              add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
              process_group: bool = True) -> None:
    """The main() of a tests/dist script under run_torchrun: parse `--out DIR` (and what `add_arguments` adds),
    make the process group (`process_group`; destroyed layouts are rebuilt per case), call `run(options, results)`
    and write `results` to DIR/rank{RANK}.json, with the traceback under "crash" when `run` raised."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    if add_arguments is not None:
        add_arguments(parser)
    opts = parser.parse_args()
    rank = int(os.environ["RANK"])
    res: dict = {}
    if process_group:
        from mppo.parallel import destroy, init_distributed

        init_distributed(1, 1)  # the process group; each case builds (and destroys) its own layout
        destroy()
    try:
        run(opts, res)
    except Exception:
        res["crash"] = traceback.format_exc()
        raise
    finally:
        opts.out.mkdir(parents=True, exist_ok=True)
        (opts.out / f"rank{rank}.json").write_text(json.dumps(res, indent=1, default=str))
