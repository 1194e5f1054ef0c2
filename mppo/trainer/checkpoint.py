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

Nothing in a checkpoint is unpickled before it is vetted. Every file under a step directory must be a regular file
listed in the manifest (an extra `.metadata` would be read by torch's loader without ever being hashed), and every
pickle-bearing file goes through `mppo.models.pickle_vetting` (allowlist unpicklers) before a step is chosen, so a
manifest rewritten to match a hostile file does not get it past either. A step that fails is reported and skipped.
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
from mppo.models.pickle_vetting import UnsafeCheckpointError, vet_files

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


def _from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (one rank reads the disk, every rank takes the same decision)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _digests(root: Path, files: list[tuple[str, int]]) -> tuple[dict[str, str], dict[str, str]]:
    """(blake2b of each readable file, {file: why a rank could not read it}) for (relative path, size) pairs
    under `root`, the hashing spread over every rank (collective; every rank gets both dicts whole).

    A checkpoint of a large model is hundreds of GB; hashed by rank 0 alone that takes minutes while every other
    rank waits in a barrier. Files are dealt largest first, round-robin, so each rank reads about 1/world of it.
    A rank that cannot read its share reports why instead of raising, so no rank is left waiting in the gather.
    """
    order = sorted(files, key=lambda f: (-f[1], f[0]))
    digests: dict[str, str] = {}
    unreadable: dict[str, str] = {}
    for rel, _ in order[_rank()::_world()]:
        try:
            digests[rel] = file_digest(root / rel)
        except FileNotFoundError:
            unreadable[rel] = (f"rank {_rank()} does not see it (the run directory must be on a file system "
                               "every node shares)")
        except OSError as err:
            unreadable[rel] = f"rank {_rank()} could not read it ({err})"
    if _world() == 1:
        return digests, unreadable
    parts: list[Any] = [None] * _world()
    dist.all_gather_object(parts, (digests, unreadable))
    return ({rel: d for part in parts for rel, d in part[0].items()},
            {rel: why for part in parts for rel, why in part[1].items()})


def _on_rank0(read: Callable[[], Any], what: str) -> Any:
    """`read()` on rank 0, its result on every rank; an error there becomes a CheckpointError on every rank
    (raised on rank 0 alone it would leave the others waiting in the broadcast)."""
    value: Any = None
    if _rank() == 0:
        try:
            value = read()
        except CheckpointError as err:
            value = err
        except Exception as err:  # noqa: BLE001 - any failure must reach every rank
            value = CheckpointError(f"{what}: {type(err).__name__}: {err}")
    value = _from_rank0(value)
    if isinstance(value, CheckpointError):
        raise CheckpointError(str(value))
    return value


def _files(root: Path) -> list[tuple[str, int]]:
    """(relative path, size) of every file under `root` but the manifest; CheckpointError for anything that is
    not a directory or a regular file (mppo writes neither symlinks nor special files; a symlink could point the
    loader at a file other than the one hashed)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted([*dirnames, *filenames]):
            path = Path(dirpath) / name
            if path.is_symlink() or not (path.is_dir() or path.is_file()):
                raise CheckpointError(f"{path}: not a regular file (a symlink or special file); mppo never writes "
                                      "one, so the step is refused")
        found += [(str((Path(dirpath) / name).relative_to(root)), (Path(dirpath) / name).stat().st_size)
                  for name in filenames]
    return sorted((rel, size) for rel, size in found if rel != MANIFEST)


def _inventory(root: Path) -> dict[str, dict[str, Any]]:
    """{relative path: size and checksum} of every file under `root` but the manifest (collective)."""
    listing = _on_rank0(lambda: _files(root), f"listing {root}")
    digests, unreadable = _digests(root, listing)
    if unreadable:
        rel, why = sorted(unreadable.items())[0]
        raise CheckpointError(f"{root / rel}: {why}")
    return {rel: {"size": size, "blake2b": digests[rel]} for rel, size in listing}


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

    def remove_partial_writes(self) -> list[Path]:
        """Delete what a crash mid-save left behind (`global_step_N.tmp`, `*.partial`); rank 0 logs each."""
        removed = []
        if _rank() == 0 and self.root.is_dir():
            for path in sorted(self.root.iterdir()):
                if path.name.endswith((".tmp", ".partial")):
                    log.warning("removing %s: a checkpoint write that did not finish", path)
                    if path.is_dir():
                        shutil.rmtree(path)
                    else:
                        path.unlink()
                    removed.append(path)
        _barrier()
        return removed

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
        if _rank() == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1, sort_keys=True))
        _barrier()
        files = _inventory(tmp)
        if _rank() == 0:
            manifest = {"step": step, "config_hash": self.config_hash, "config": self.resume_config,
                        "layout": self.layout, "files": files}
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
        """Return the manifest of a complete, uncorrupted checkpoint, else raise CheckpointError with the reason.

        Collective under torch.distributed: rank 0 reads the manifest, refuses files it does not list and checks
        sizes, every rank hashes a share of the files, rank 0 vets the pickles; every rank raises the same error
        or returns the same manifest.
        """
        manifest = _on_rank0(lambda: _read_manifest(path), f"{path / MANIFEST}: unreadable manifest")
        listed = manifest["files"]

        def size_problem() -> str | None:
            unlisted = sorted({rel for rel, _ in _files(path)} - set(listed))
            if unlisted:
                return (f"{path / unlisted[0]}: not listed in the manifest (a file added after the checkpoint was "
                        "written; every file of a step must be listed, so the step is refused)")
            for rel, expected in sorted(listed.items()):
                file = path / rel
                if not file.is_file():
                    return f"{file}: listed in the manifest but missing"
                if file.stat().st_size != expected["size"]:
                    return f"{file}: size {file.stat().st_size} != {expected['size']} in the manifest"
            return None

        problem = _on_rank0(size_problem, f"{path}: checking the files against the manifest")
        if problem:
            raise CheckpointError(problem)
        digests, unreadable = _digests(path, [(rel, expected["size"]) for rel, expected in listed.items()])
        if unreadable:
            rel, why = sorted(unreadable.items())[0]
            raise CheckpointError(f"{path / rel}: {why}")
        for rel, expected in sorted(listed.items()):
            if digests.get(rel) != expected["blake2b"]:
                raise CheckpointError(f"{path / rel}: checksum does not match the manifest (corrupt)")

        def vet() -> None:
            try:
                vet_files(path / rel for rel in listed)  # every file: the check above left no unlisted one
            except UnsafeCheckpointError as err:
                raise CheckpointError(str(err)) from err

        _on_rank0(vet, f"{path}: vetting pickles")
        return manifest

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint that belongs to this run; corrupt ones are reported and skipped.

        A complete checkpoint of ANOTHER run (different model or incompatible config) is an error, not a skip:
        resuming from it would silently change the run. Collective: every rank takes the same decision.
        """
        steps = _on_rank0(lambda: sorted(self._candidate_steps(), reverse=True), f"listing {self.root}")
        for step in steps:
            path = self.step_dir(step)
            try:
                manifest = self.verify(path)
            except CheckpointError as err:
                if _rank() == 0:
                    log.warning("skipping checkpoint %s", err)
                continue
            _on_rank0(lambda: self.check_compatible(path, manifest), f"{path}: comparing with this run")
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


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (the write did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, OSError) as err:  # JSON or UTF-8 errors are ValueErrors
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({err})") from err
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)
            and all(isinstance(v, dict) and {"size", "blake2b"} <= set(v) for v in manifest["files"].values())):
        raise CheckpointError(f"{manifest_path}: not an mppo checkpoint manifest (no files with size and checksum)")
    return manifest


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
