"""Run checkpoints: atomic step directories with a manifest, latest-good detection, and retention.

Layout under `<run_dir>/checkpoints/`:

    global_step_20/
        actor/ critic/ ...         written by the workers (megatron dist_checkpointing, every rank)
        trainer_state.json         step, data position, KL controller, ...
        manifest.json              written LAST: step, config hash, layout, size + checksum of every file
    latest_checkpointed_iteration.txt

A step directory is first written as `global_step_20.tmp` and renamed only once the manifest is complete, so a
crash at any moment leaves either the old set of checkpoints or the old set plus one complete new one. A directory
whose manifest is missing or whose files do not match it is reported by path and reason and skipped.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mppo.errors import UserError

log = logging.getLogger("mppo")

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
LATEST = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used for this run; the message names the path and what differs."""


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    manifest: dict[str, Any]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _inventory(root: Path) -> dict[str, dict[str, Any]]:
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            files[str(path.relative_to(root))] = {"size": path.stat().st_size, "blake2b": file_digest(path)}
    return files


class CheckpointManager:
    """Saves and finds run checkpoints. Every rank calls save()/latest(); rank 0 does the file bookkeeping."""

    def __init__(self, run_dir: str | Path, *, resume_config: Mapping[str, Any], layout: Mapping[str, Any],
                 max_to_keep: int | None = None) -> None:
        """`resume_config`: the flat {dotted key: value} of every key a resumed run must share with the saved one."""
        self.root = Path(run_dir) / "checkpoints"
        self.resume_config = dict(resume_config)
        self.config_hash = hashlib.sha256(json.dumps(self.resume_config, sort_keys=True, default=str)
                                          .encode()).hexdigest()[:16]
        self.layout = dict(layout)
        self.max_to_keep = max_to_keep

    def step_dir(self, step: int) -> Path:
        return self.root / f"global_step_{step}"

    # ------------------------------------------------------------------------------------------------- saving
    def save(self, step: int, writers: Mapping[str, Callable[[Path], None]], trainer_state: dict[str, Any],
             *, fault_hook: Callable[[str], None] | None = None) -> Path:
        """Write a complete checkpoint for `step`. `writers[name](dir)` is called on every rank with `tmp/name`."""
        final, tmp = self.step_dir(step), self.root / f"global_step_{step}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash mid-write
            tmp.mkdir(parents=True)
        _barrier()
        for name, write in writers.items():
            write(tmp / name)
            if fault_hook:
                fault_hook(f"after:{name}")
        _barrier()
        if _rank() == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1, sort_keys=True))
            manifest = {"step": step, "config_hash": self.config_hash, "config": self.resume_config,
                        "layout": self.layout, "files": _inventory(tmp)}
            _write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
            if fault_hook:
                fault_hook("before:rename")
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_atomic(self.root / LATEST, str(step))
            self._apply_retention()
        _barrier()
        return final

    def _apply_retention(self) -> None:
        if not self.max_to_keep or self.max_to_keep <= 0:
            return
        steps = sorted(self._candidate_steps())
        for step in steps[:-self.max_to_keep]:
            shutil.rmtree(self.step_dir(step), ignore_errors=True)

    # ------------------------------------------------------------------------------------------------- finding
    def _candidate_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return [int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]

    def verify(self, path: Path) -> dict[str, Any]:
        """Return the manifest of a complete, uncorrupted checkpoint, else raise CheckpointError with the reason."""
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{path}: no {MANIFEST} (the write did not finish)")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{manifest_path}: unreadable manifest ({err})") from err
        for rel, expected in manifest.get("files", {}).items():
            file = path / rel
            if not file.is_file():
                raise CheckpointError(f"{file}: listed in the manifest but missing")
            if file.stat().st_size != expected["size"]:
                raise CheckpointError(f"{file}: size {file.stat().st_size} != {expected['size']} in the manifest")
            if file_digest(file) != expected["blake2b"]:
                raise CheckpointError(f"{file}: checksum does not match the manifest (corrupt)")
        return manifest

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint that belongs to this run; corrupt ones are reported and skipped.

        A complete checkpoint of ANOTHER run (different model or incompatible config) is an error, not a skip:
        resuming from it would silently change the run.
        """
        for step in sorted(self._candidate_steps(), reverse=True):
            path = self.step_dir(step)
            try:
                manifest = self.verify(path)
            except CheckpointError as err:
                if _rank() == 0:
                    log.warning("skipping checkpoint %s", err)
                continue
            self.check_compatible(path, manifest)
            return CheckpointInfo(step=step, path=path, manifest=manifest)
        return None

    def check_compatible(self, path: Path, manifest: Mapping[str, Any]) -> None:
        if manifest.get("config_hash") != self.config_hash:
            raise CheckpointError(
                f"{path} was written by a run with a different config: "
                f"{_diff(manifest.get('config', {}), self.resume_config)}. Restore those values to resume, or use "
                "a new trainer.default_local_dir (or trainer.resume_mode=disable) to start fresh")
        diff = _diff(manifest.get("layout", {}), self.layout)
        if diff:
            raise CheckpointError(f"{path} has layout {diff}; this run differs. Resharding a full run checkpoint "
                                  "is not supported: convert the model with `mppo convert` and start a new run")

    @staticmethod
    def load_trainer_state(info: CheckpointInfo) -> dict[str, Any]:
        return json.loads((info.path / TRAINER_STATE).read_text())


def _diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    keys = sorted(set(saved) | set(current))
    return ", ".join(f"{k}: {saved.get(k)!r} (checkpoint) vs {current.get(k)!r} (now)"
                     for k in keys if saved.get(k) != current.get(k))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
