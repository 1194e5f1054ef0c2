"""mppo.rollout.factory without engines: rollout groups, prompt shares, the response packing, and the rollout
checks of config validation and `mppo train --dry-run` (before any model is built)."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

from mppo.config import ConfigError
from mppo.rollout import RolloutResponse
from mppo.rollout.factory import _pack, _unpack, rollout_layout
from dist_util import REPO


def test_groups_are_consecutive_ranks_of_one_node():
    # 2 nodes x 4 ranks, engines of TP 2: groups (0,1) (2,3) | (4,5) (6,7); rank 5 is local rank 1 on node 1
    layout = rollout_layout(2, rank=5, world=8, local_rank=1, local_world=4)
    assert layout.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert layout.ranks == (4, 5) and layout.group_index == 2 and not layout.is_driver
    assert layout.base_gpu_id == 0 and layout.engine_tp == 2
    assert layout.destinations == list(range(8))
    driver = rollout_layout(2, rank=6, world=8, local_rank=2, local_world=4)
    assert driver.is_driver and driver.base_gpu_id == 2
    assert rollout_layout(1, rank=3, world=4, local_rank=3, local_world=4).groups == ((0,), (1,), (2,), (3,))
    with pytest.raises(ConfigError, match="does not divide the 4 ranks per node"):
        rollout_layout(3, rank=0, world=8, local_rank=0, local_world=4)


def test_shares_cover_the_prompts_in_order():
    layout = rollout_layout(1, rank=0, world=3, local_rank=0, local_world=3)
    for prompts in (0, 1, 2, 3, 7, 8, 9):
        shares = [layout.share(prompts, g) for g in range(3)]
        assert [i for s in shares for i in s] == list(range(prompts))  # contiguous, in group order
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_packed_responses_round_trip():
    responses = [RolloutResponse(3, 0, [5, 6, 7], [-0.5, -1.25, -3.0], "stop"),
                 RolloutResponse(3, 1, [], [], "length"),
                 RolloutResponse(4, 0, [9], [-1e-7], "length")]
    assert _unpack(_pack(responses)) == responses
    assert _unpack(_pack([])) == []


def test_packed_routed_experts_round_trip():
    import torch

    routes = [torch.randint(0, 8, (n, 3, 2), dtype=torch.int32) for n in (4, 2)]
    responses = [RolloutResponse(0, 0, [5, 6], [-0.5, -1.0], "stop", routed_experts=routes[0]),
                 RolloutResponse(1, 0, [9], [-2.0], "length", routed_experts=routes[1])]
    back = _unpack(_pack(responses))
    assert [(r.prompt_index, r.token_ids, r.log_probs) for r in back] == [(0, [5, 6], [-0.5, -1.0]), (1, [9], [-2.0])]
    assert all(torch.equal(a.routed_experts, b) for a, b in zip(back, routes))
    assert all(r.routed_experts is None for r in _unpack(_pack([RolloutResponse(0, 0, [1], [0.0], "stop")])))


def _load(*overrides: str, world: int = 2):
    from mppo.config import load_config

    return load_config(str(REPO / "configs" / "demo_cpu.yaml"), ["actor_rollout_ref.model.path=/m", *overrides],
                       world_size=world)


def test_validation_rejects_rollout_layouts_that_cannot_run():
    with pytest.raises(ConfigError, match=r"rollout.tensor_model_parallel_size = 2: the CPU engine has no tensor "
                                          r"parallelism.*set it to 1"):
        _load("actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size = 3: an engine must live within one node of 2 "
                                          r"ranks.*use a divisor of 2"):
        _load("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=3")
    cfg = _load("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=2")
    assert cfg.actor_rollout_ref.rollout.free_cache_engine is True
    assert cfg.critic.megatron.param_offload is False and cfg.actor_rollout_ref.ref.megatron.optimizer_offload is False


def _dry_run(tmp_path, sglang_version: str | None):
    """`mppo train --dry-run` with rollout.name=sglang in a Python whose package metadata says sglang is
    `sglang_version` (None: not installed)."""
    answer = "raise md.PackageNotFoundError(name)" if sglang_version is None else f"return {sglang_version!r}"
    code = ("import importlib.metadata as md, sys\n"
            "real = md.version\n"
            f"def version(name):\n    if name == 'sglang':\n        {answer}\n    return real(name)\n"
            "md.version = version\n"
            "from mppo.cli import main\n"
            "sys.exit(main(['train', 'configs/demo_cpu.yaml', '--dry-run', 'actor_rollout_ref.model.path=/m', "
            "'actor_rollout_ref.rollout.name=sglang']))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "RUN_DIR": str(tmp_path)})


@pytest.mark.parametrize("version, message", [
    (None, "needs SGLang, which is not installed: pip install 'mppo[gpu]'"),
    ("0.5.9", "needs sglang>=0.5.23,<0.6, found sglang 0.5.9"),
])
def test_dry_run_names_a_missing_or_wrong_sglang(tmp_path, version, message):
    proc = _dry_run(tmp_path, version)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("mppo: error: actor_rollout_ref.rollout.name=sglang"), lines
    assert message in lines[0] and "make sglang" in lines[0], lines


def test_dry_run_passes_with_the_installed_sglang(tmp_path):
    proc = _dry_run(tmp_path, importlib.metadata.version("sglang"))  # make test installs it (make sglang)
    assert proc.returncode == 0, proc.stderr[-2000:]
