"""Write a directory atomically: every rank writes into a temporary sibling, rank 0 renames it at the end.

A crash mid-write leaves the temporary directory behind, never a half-written `out_dir`.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Iterator

import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def atomic_directory(out_dir: str | Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory on every rank; on success rank 0 renames it to `out_dir`.

    Collective when torch.distributed is initialised (all ranks enter and leave together). The temporary
    directory sits next to `out_dir`, so the rename stays on one file system.
    """
    out = Path(out_dir).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass a new directory or remove it first")
    tmp = out.parent / f".{out.name}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    yield tmp
    _barrier()
    if _rank() == 0:
        old = out.parent / f".{out.name}.old"
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
