"""Crash-safe resume: SIGKILL during rollout, during the update and mid-checkpoint, a corrupt checkpoint, and a
restart of the same command each time; the metrics must continue bit-identically to an uninterrupted run.

Two ranks (DP=2), the real CLI, tiny assets. The uninterrupted reference's ranks are forked (tests/dist_util.train_cli:
launching is not its subject); then one chain of four launches in one run directory, the first under torchrun (a
rank's death is its subject), the others with forked ranks (what they test is what the run directory holds):

    launch 1  kill rank 1 in step 2's rollout (gen)    → checkpoint 1 complete; torchrun stops rank 0 too
    launch 2  kill every rank in step 3's actor update  → resumes from 1, writes 2
    launch 3  kill every rank while checkpoint 3 is half written (after the actor's part)
              → resumes from 2, leaves global_step_3.tmp
    (the test flips a byte in checkpoint 2)
    launch 4  no fault → removes the .tmp, reports checkpoint 2 as corrupt by path and reason, resumes from 1 and
              finishes; trainer.max_ckpt_to_keep=2 leaves checkpoints 2 and 3
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from dist_util import train_cli
from e2e_assets import dense_reward, tiny_overrides
from reliability_launch import computed, read_metrics, session_assets, train

STEPS = 3


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    """The tiny assets with dropout in the model's config.json (read as veRL does, applied in updates): dropout
    draws from the RNG the checkpoint saves, so a resume that did not restore it would not continue bit-identically
    (every other random draw is derived from the seed, the step and the sample)."""
    root = tmp_path_factory.mktemp("resume_assets")
    shutil.copytree(session_assets(tmp_path_factory), root, dirs_exist_ok=True)
    config = json.loads((root / "model" / "config.json").read_text())
    config.update(attention_dropout=0.1, hidden_dropout=0.1)
    (root / "model" / "config.json").write_text(json.dumps(config))
    return root


def _overrides(assets: Path, run_dir: Path) -> list[str]:
    return tiny_overrides(assets, run_dir, world=2, steps=STEPS) + dense_reward(assets) + ["trainer.max_ckpt_to_keep=2"]


def _killed(launch, rank: str = r"\d") -> None:
    assert launch.returncode != 0, launch.output[-3000:]
    assert re.search(rf"mppo: fault injection \[rank {rank}\]: kill at step", launch.output), launch.output[-3000:]
    assert -9 in launch.child_exit_codes(), launch.output[-3000:]  # SIGKILL


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_kill_anywhere_then_restart_continues_bit_identically(assets, tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"

    def launch(name: str, run_dir: Path, fault: str | None = None, forked: bool = True):
        return train(_overrides(assets, run_dir), env={"MPPO_FAULT": fault} if fault else None,
                     log=tmp_path / f"{name}.log", forked=forked)

    train_cli(2, _overrides(assets, straight))  # the uninterrupted reference (ranks forked: not the subject here)

    first = launch("first", crashed, "kill@step:2:phase:gen:rank:1", forked=False)
    _killed(first, "1")
    assert "fault injection [rank 0]" not in first.output  # rank 0 was stopped by torchrun, not by the fault
    ckpts = crashed / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("global_step_*")) == ["global_step_1"]

    second = launch("second", crashed, "kill@step:3:phase:update_actor")
    _killed(second)
    assert f"resumed from {ckpts / 'global_step_1'} (step 1)" in second.output

    third = launch("third", crashed, "kill@step:3:checkpoint:after:actor")
    _killed(third)
    assert f"resumed from {ckpts / 'global_step_2'} (step 2)" in third.output
    partial = ckpts / "global_step_3.tmp"
    assert (partial / "actor").is_dir() and not (partial / "critic").exists()  # killed half-way through
    assert not (ckpts / "global_step_3").exists()

    corrupt = min((ckpts / "global_step_2" / "critic" / "model").glob("*.distcp"))
    _flip_a_byte(corrupt)
    last = launch("last", crashed)
    assert last.returncode == 0, last.output[-4000:]
    assert f"removing {partial}: a checkpoint write that did not finish" in last.output
    assert f"skipping checkpoint {corrupt}: checksum does not match the manifest (corrupt)" in last.output
    assert f"resumed from {ckpts / 'global_step_1'} (step 1)" in last.output
    assert sorted(p.name for p in ckpts.iterdir()) == ["global_step_2", "global_step_3",
                                                       "latest_checkpointed_iteration.txt"]

    want, got = read_metrics(straight), read_metrics(crashed)
    assert sorted(got) == sorted(want) == list(range(STEPS + 1))
    for step in want:
        assert computed(got[step]) == computed(want[step]), step
    assert {"actor/pg_loss", "critic/vf_loss", "actor/lr", "critic/score/mean", "val/test_score/countdown",
            "actor/grad_norm"} <= set(want[STEPS])
    # Every kill and resume left the run where it was: one metrics line per step, no duplicates.
    lines = (crashed / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(straight.joinpath("metrics.jsonl").read_text().splitlines())
