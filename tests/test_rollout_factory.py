"""mppo.rollout.factory without engines: rollout groups, prompt shares, the response packing, and the rollout
checks of config validation and `mppo train --dry-run` (before any model is built)."""
from __future__ import annotations

import importlib.metadata

import pytest
import yaml

from mppo.config import ConfigError, load_config
from mppo.rollout import RolloutResponse
from mppo.rollout.factory import pack_responses, rollout_layout, unpack_responses
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
    with pytest.raises(ValueError, match="does not divide the 4 ranks per node"):
        rollout_layout(3, rank=0, world=8, local_rank=0, local_world=4)


def test_an_engine_that_does_not_fit_a_node_of_the_launch_stops_at_start_up(monkeypatch):
    """The config's trainer.n_gpus_per_node is validated; the launch's own node size (torchrun's
    LOCAL_WORLD_SIZE) is checked at start-up by mppo.preflight."""
    from mppo.preflight import check_rollout_launch

    cfg = load_config(None, ["actor_rollout_ref.rollout.tensor_model_parallel_size=4"])  # 8 ranks per node
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    check_rollout_launch(cfg)  # not under torchrun: nothing to check
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    check_rollout_launch(cfg)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size = 4: an engine's ranks must lie on one node, "
                                          r"but it does not divide the 6 ranks per node of this launch"):
        check_rollout_launch(cfg)


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
    assert unpack_responses(pack_responses(responses)) == responses
    assert unpack_responses(pack_responses([])) == []


def test_packed_routed_experts_round_trip():
    import torch

    routes = [torch.randint(0, 8, (n, 3, 2), dtype=torch.int32) for n in (4, 2)]
    responses = [RolloutResponse(0, 0, [5, 6], [-0.5, -1.0], "stop", routed_experts=routes[0]),
                 RolloutResponse(1, 0, [9], [-2.0], "length", routed_experts=routes[1])]
    back = unpack_responses(pack_responses(responses))
    assert [(r.prompt_index, r.token_ids, r.log_probs) for r in back] == [(0, [5, 6], [-0.5, -1.0]), (1, [9], [-2.0])]
    assert all(torch.equal(a.routed_experts, b) for a, b in zip(back, routes))
    assert all(r.routed_experts is None for r in unpack_responses(pack_responses([RolloutResponse(0, 0, [1], [0.0], "stop")])))


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


def _sglang_here(monkeypatch, version: str | None) -> None:
    """This process's package metadata says SGLang `version` is installed (None: not installed): the probe of a
    login node or laptop, with no SGLang imported."""
    real = importlib.metadata.version

    def version_of(name: str) -> str:
        if name != "sglang":
            return real(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", version_of)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


PPO_TRAINER = str(REPO / "configs/ppo_trainer.yaml")  # rollout.name: sglang
SGLANG_NOT_HERE = [
    (None, "SGLang is not installed here; the run needs it"),
    ("0.5.9", "SGLang is not installed here in a version the run can use (found sglang 0.5.9); the run needs it"),
]


@pytest.mark.parametrize("version, found", SGLANG_NOT_HERE)
def test_dry_run_and_plan_only_warn_of_a_missing_or_wrong_sglang(monkeypatch, capsys, version, found):
    """Planning a GPU run from a machine without SGLang (issue 24): `mppo train --dry-run` and `mppo plan` validate
    and plan, exit 0, and say once that the run needs SGLang (before: the dry run stopped with exit 2, and `mppo
    plan` did not check the rollout at all)."""
    from mppo.cli import main

    _sglang_here(monkeypatch, version)
    assert main(["train", PPO_TRAINER, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["actor_rollout_ref"]["rollout"]["name"] == "sglang"
    assert "# plan: not computed" in out  # the plan part still runs
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mppo: warning: {found} "), lines
    assert "sglang>=0.5.23,<0.6" in lines[0] and "make sglang" in lines[0], lines
    # two configs planned at once: still one warning, and the same one
    assert main(["plan", PPO_TRAINER, PPO_TRAINER, "--hf-config", "Qwen2.5-0.5B"]) == 0
    out, err = capsys.readouterr()
    assert out.count("verdict: FITS") == 2 and err.splitlines() == lines


@pytest.mark.parametrize("version, message", [
    (None, "needs SGLang, which is not installed: pip install 'mppo[gpu]'"),
    ("0.5.9", "needs sglang>=0.5.23,<0.6, found sglang 0.5.9"),
])
def test_the_run_refuses_a_missing_or_wrong_sglang_at_start_up(monkeypatch, capsys, tmp_path, version, message):
    """What --dry-run only warns of stops the run itself, first thing (before the data and the model path, which
    do not exist here): one error line naming the fix, no warning."""
    from mppo.cli import main

    _sglang_here(monkeypatch, version)
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    assert main(["train", str(REPO / "configs/demo_cpu.yaml"), "actor_rollout_ref.rollout.name=sglang"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mppo: error: actor_rollout_ref.rollout.name=sglang: "), lines
    assert message in lines[0] and "make sglang" in lines[0], lines


def test_dry_run_and_plan_are_quiet_with_a_supported_sglang(monkeypatch, capsys):
    from mppo.cli import main

    _sglang_here(monkeypatch, "0.5.23")
    assert main(["train", PPO_TRAINER, "--dry-run"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["plan", PPO_TRAINER, "--hf-config", "Qwen2.5-0.5B"]) == 0
    assert capsys.readouterr().err == ""
