"""Vetting of the pickles in a checkpoint before megatron's or torch's loader sees them.

megatron-core's dist_checkpointing reads, in a model directory it is given:
    metadata.json     JSON (safe)
    common.pt         `torch.load` without an explicit `weights_only` (safe only while torch's default is True)
    <key>.pt          sharded objects of the old format, same
    .metadata         torch.distributed.checkpoint: plain `pickle.load`; if that fails torch falls back to the
                      rank-local `__<rank>.metadata`, also a plain `pickle.load`
    *.distcp          concatenated `torch.save` blobs at the offsets `.metadata` gives: tensor entries are read
                      with `weights_only=True`, byte entries (e.g. layers' `_extra_state`) with `weights_only=False`
So every `*.metadata` is unpickled here with an allowlist of torch's checkpoint-metadata classes, every byte entry
it points at and every `*.pt` (and any other file whose bytes open like a pickle or a torch archive) is loaded with
`torch.load(weights_only=True)`, itself an allowlist unpickler. Anything else is an UnsafeCheckpointError naming
the file. Vetting reads the files once; a file swapped between the vetting and the load (TOCTOU) is not covered.
"""
from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from mppo.errors import UserError

_ADVICE = "only load checkpoints written by mppo from a trusted place"
# How a pickle (protocol 2+) or a torch.save zip archive starts.
_PICKLE_MAGIC, _ZIP_MAGIC = b"\x80", b"PK\x03\x04"
# Binary formats that hold no pickle but may start with those bytes (a .distcp's first entry is a torch archive).
_NO_PICKLE_SUFFIXES = (".distcp", ".safetensors")


class UnsafeCheckpointError(UserError, ValueError):
    """A checkpoint file that could run code when loaded; the message names the file."""


# Every global a torch.distributed.checkpoint `.metadata` pickle may name: its metadata dataclasses and enums,
# torch's Size, dtypes and layout lookup, and paths. Constructing these from untrusted arguments runs no foreign code.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "ChunkStorageMetadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id when saved with a Path
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Exact names only: a dotted `name` would let pickle walk attributes (`Metadata.__init__.__globals__`).
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in _METADATA_GLOBALS.get(module, ()) or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it references {module}.{name}, which is not checkpoint metadata")


def is_dcp_metadata(file: Path) -> bool:
    """`.metadata` or a rank-local `__<rank>.metadata`: what torch.distributed.checkpoint unpickles."""
    return file.name.endswith(".metadata")


def _opens_like_a_pickle(file: Path) -> bool:
    with file.open("rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    return head.startswith(_PICKLE_MAGIC) or head == _ZIP_MAGIC


def vet_file(file: Path) -> None:
    """Raise UnsafeCheckpointError unless every pickle in `file` is plain checkpoint data (see the module docstring).

    `*.distcp` files are vetted through the `.metadata` that points into them (their tensor entries torch already
    reads with `weights_only=True`); JSON, safetensors and tokenizer files hold no pickle and pass as they are.
    """
    try:
        if is_dcp_metadata(file):
            with file.open("rb") as f:
                metadata = _MetadataUnpickler(f).load()
            _vet_entries(file, metadata)
        elif file.suffix == ".pt" or (file.suffix not in _NO_PICKLE_SUFFIXES and _opens_like_a_pickle(file)):
            torch.load(file, map_location="cpu", weights_only=True)
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # an unpickling error, or a file that is not what its name says
        raise UnsafeCheckpointError(f"{file}: refused to unpickle ({type(err).__name__}: {err}); {_ADVICE}") from err


def _vet_entries(metadata_file: Path, metadata: Any) -> None:
    """The byte entries a `.metadata` points at, loaded with weights_only=True (torch would use False)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpointError(f"{metadata_file}: not torch.distributed.checkpoint metadata "
                                    f"({type(metadata).__name__}); {_ADVICE}")
    model_dir = metadata_file.parent
    for index, info in metadata.storage_data.items():
        if Path(info.relative_path).name != info.relative_path or info.relative_path in ("", ".", ".."):
            raise UnsafeCheckpointError(f"{metadata_file}: entry {index.fqn} points outside its directory "
                                        f"({info.relative_path!r}); {_ADVICE}")
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if info.transform_descriptors:  # mppo never writes transformed (e.g. compressed) entries
            raise UnsafeCheckpointError(f"{model_dir / info.relative_path}: entry {index.fqn} is stored with "
                                        f"transforms {info.transform_descriptors}, which mppo does not write")
        with (model_dir / info.relative_path).open("rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as err:
            raise UnsafeCheckpointError(
                f"{model_dir / info.relative_path}: entry {index.fqn} (named in {metadata_file}): refused to "
                f"unpickle ({type(err).__name__}: {err}); {_ADVICE}") from err


def vet_files(files: Iterable[Path]) -> None:
    for file in sorted(files):
        vet_file(file)


def vet_checkpoint_dir(root: str | Path) -> None:
    """Vet every file under `root` (a dist checkpoint's model directory, or a whole worker checkpoint) before a
    loader reads it. Symlinks are refused: mppo never writes them, and one would let the vetted and the loaded
    file differ."""
    root = Path(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if path.is_symlink():
                raise UnsafeCheckpointError(f"{path}: a symlink in a checkpoint (mppo never writes one); {_ADVICE}")
        files += [Path(dirpath) / name for name in filenames]
    vet_files(files)
