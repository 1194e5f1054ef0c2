"""Run checkpoints: atomic writes, corrupt/partial detection with fallback, retention, mismatched configs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mppo.trainer.checkpoint import CheckpointError, CheckpointManager


def _writer(payload: bytes):
    def write(path: Path) -> None:
        path.mkdir(parents=True)
        (path / "shard.bin").write_bytes(payload)
    return write


def _manager(tmp_path: Path, **kw) -> CheckpointManager:
    kw.setdefault("resume_config", {"actor.lr": 1e-6, "model.path": "m"})
    kw.setdefault("layout", {"tp": 1, "pp": 1, "dp": 1})
    return CheckpointManager(tmp_path, **kw)


def test_save_then_latest_round_trip(tmp_path):
    mgr = _manager(tmp_path)
    mgr.save(2, {"actor": _writer(b"two")}, {"step": 2, "data": {"position": 2}})
    info = mgr.latest()
    assert info is not None and info.step == 2
    assert (info.path / "actor" / "shard.bin").read_bytes() == b"two"
    assert mgr.load_trainer_state(info)["data"] == {"position": 2}
    assert (mgr.root / "latest_checkpointed_iteration.txt").read_text() == "2"


def test_crash_mid_write_leaves_previous_checkpoint(tmp_path):
    mgr = _manager(tmp_path)
    mgr.save(1, {"actor": _writer(b"one")}, {"step": 1})

    def crash(point: str) -> None:
        if point == "before:rename":
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, {"actor": _writer(b"two")}, {"step": 2}, fault_hook=crash)
    assert mgr.latest().step == 1
    # The next save of the same step cleans the leftover temporary directory.
    mgr.save(2, {"actor": _writer(b"two")}, {"step": 2})
    assert mgr.latest().step == 2 and not (mgr.root / "global_step_2.tmp").exists()


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove_manifest", "remove_file"])
def test_corrupt_checkpoint_is_reported_and_skipped(tmp_path, caplog, damage):
    mgr = _manager(tmp_path)
    mgr.save(1, {"actor": _writer(b"one")}, {"step": 1})
    mgr.save(2, {"actor": _writer(b"two-two")}, {"step": 2})
    shard = mgr.step_dir(2) / "actor" / "shard.bin"
    if damage == "truncate":
        shard.write_bytes(b"tw")
    elif damage == "flip":
        shard.write_bytes(b"twX-two")
    elif damage == "remove_manifest":
        (mgr.step_dir(2) / "manifest.json").unlink()
    else:
        shard.unlink()
    with caplog.at_level("WARNING", logger="mppo"):
        info = mgr.latest()
    assert info.step == 1
    assert str(mgr.step_dir(2)) in caplog.text


def test_retention_keeps_newest(tmp_path):
    mgr = _manager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, {"actor": _writer(str(step).encode())}, {"step": step})
    kept = sorted(p.name for p in mgr.root.iterdir() if p.is_dir())
    assert kept == ["global_step_3", "global_step_4"]


def test_checkpoint_of_another_config_names_the_difference(tmp_path):
    _manager(tmp_path).save(1, {"actor": _writer(b"x")}, {"step": 1})
    other = _manager(tmp_path, resume_config={"actor.lr": 3e-6, "model.path": "m"})
    with pytest.raises(CheckpointError, match=r"actor\.lr: 1e-06 \(checkpoint\) vs 3e-06 \(now\)"):
        other.latest()


def test_checkpoint_of_another_layout_is_refused(tmp_path):
    _manager(tmp_path).save(1, {"actor": _writer(b"x")}, {"step": 1})
    other = _manager(tmp_path, layout={"tp": 2, "pp": 1, "dp": 1})
    with pytest.raises(CheckpointError, match=r"tp: 1 \(checkpoint\) vs 2 \(now\)"):
        other.latest()


def test_manifest_lists_every_file_with_checksum(tmp_path):
    mgr = _manager(tmp_path)
    path = mgr.save(5, {"actor": _writer(b"abc"), "critic": _writer(b"defg")}, {"step": 5})
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"actor/shard.bin", "critic/shard.bin", "trainer_state.json"}
    assert manifest["files"]["critic/shard.bin"]["size"] == 4
    assert manifest["step"] == 5 and manifest["layout"] == {"tp": 1, "pp": 1, "dp": 1}


def test_turning_the_generation_dump_on_does_not_block_a_resume(tmp_path):
    from dist_util import REPO
    from mppo.config import load_config
    from mppo.trainer.resume import resume_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))

    def facts(*overrides: str) -> dict:
        return resume_config(load_config(str(REPO / "configs" / "demo_cpu.yaml"),
                                          [f"actor_rollout_ref.model.path={model}", *overrides], world_size=2))

    assert facts() == facts(f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")
    assert facts() != facts("actor_rollout_ref.actor.optim.lr=1e-3")  # what changes the run still does
