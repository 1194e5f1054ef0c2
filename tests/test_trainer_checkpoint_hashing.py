"""Checkpoint checksums are computed by all ranks together (each hashes ~1/world of the bytes), and give the same
manifest as one process hashing everything. Two gloo ranks in spawned processes, no megatron."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _blake2b(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def _worker(rank: int, root: str, store: str, out: str) -> None:
    from mppo.trainer import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    hashed: list[str] = []
    real = checkpoint.file_digest
    checkpoint.file_digest = lambda path: (hashed.append(path.name), real(path))[1]
    inventory = checkpoint._inventory(Path(root))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"inventory": inventory, "hashed": hashed}))
    dist.destroy_process_group()


def test_ranks_share_the_hashing_and_agree_with_one_process(tmp_path):
    root = tmp_path / "ckpt"
    sizes = {"actor/__0_0.distcp": 5000, "actor/__1_0.distcp": 4000, "actor/.metadata": 300,
             "critic/__0_0.distcp": 2500, "trainer_state.json": 40}
    for i, (rel, size) in enumerate(sizes.items()):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))
    (root / "manifest.json").write_text("{}")  # never listed
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_worker, args=(str(root), str(tmp_path / "store"), str(out)), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    expected = {rel: {"size": size, "blake2b": _blake2b(root / rel)} for rel, size in sizes.items()}
    assert ranks[0]["inventory"] == ranks[1]["inventory"] == expected
    # largest first, dealt round-robin: rank 0 gets 5000 + 2500 + 40 bytes, rank 1 4000 + 300
    assert sorted(ranks[0]["hashed"]) == sorted(["__0_0.distcp", "__0_0.distcp", "trainer_state.json"])
    assert sorted(ranks[1]["hashed"]) == [".metadata", "__1_0.distcp"]


def _unreadable_worker(rank: int, root: str, store: str, out: str) -> None:
    from mppo.trainer import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    real = checkpoint.file_digest

    def digest(path: Path) -> str:
        if rank == 1 and path.name == "b.bin":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    checkpoint.file_digest = digest
    try:
        checkpoint._inventory(Path(root))
        result = "no error"
    except checkpoint.CheckpointError as err:
        result = str(err)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def test_a_file_one_rank_cannot_read_stops_every_rank_with_its_name(tmp_path):
    """Raised on one rank only, the error would leave the other waiting in the gather until the timeout."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "a.bin").write_bytes(b"x" * 3000)
    (root / "b.bin").write_bytes(b"y" * 2000)  # dealt to rank 1 (second largest)
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_unreadable_worker, args=(str(root), str(tmp_path / "store"), str(out)), nprocs=2,
                       join=True, start_method="spawn")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    assert "b.bin: rank 1 could not read it" in results[0] and "Permission denied" in results[0]


def test_a_manifest_that_is_not_json_text_is_skipped_not_a_crash(tmp_path):
    from mppo.trainer.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(tmp_path, resume_config={"a": 1}, layout={"tp": 1})
    bad = manager.step_dir(3)
    bad.mkdir(parents=True)
    (bad / "manifest.json").write_bytes(b"\xff\xfe not utf-8")
    try:
        manager.verify(bad)
        raise AssertionError("verify accepted a manifest of invalid UTF-8")
    except CheckpointError as err:
        assert "unreadable manifest" in str(err)
    (bad / "manifest.json").write_text("[1, 2]")
    try:
        manager.verify(bad)
        raise AssertionError("verify accepted a manifest that is a list")
    except CheckpointError as err:
        assert "not an mppo checkpoint manifest" in str(err)
    assert manager.latest() is None  # skipped with a warning, nothing else to resume from
