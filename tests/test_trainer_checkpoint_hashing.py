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
