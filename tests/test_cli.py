"""The `mppo` command line: train --dry-run, user errors without tracebacks, subcommand dispatch."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from mppo import cli
from mppo.config import load_config, to_yaml

REPO = Path(__file__).resolve().parent.parent
RECIPES = {  # recipe -> the world size it is meant for
    "ppo_trainer.yaml": 8,
    "demo.yaml": 2,
    "demo_cpu.yaml": 2,
    "countdown_tool_smollm2.yaml": 2,
    "countdown_qwen2.5_3b_ppo.yaml": 2,
    "gsm8k_qwen2.5_7b_grpo.yaml": 8,
    "qwen2.5_32b_4node.yaml": 32,
    "qwen3_30b_a3b_grpo.yaml": 16,
    "qwen2_5_7b_grpo_32k_cp.yaml": 8,
    "qwen2_5_7b_grpo_lora.yaml": 1,
}


@pytest.fixture(autouse=True)
def _not_under_torchrun(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def fake_module(monkeypatch, name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


# ---------------------------------------------------------------------------------------------------------- train
def test_every_recipe_is_covered():
    assert sorted(RECIPES) == sorted(p.name for p in (REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_dry_run(capsys, monkeypatch, recipe):
    path = str(REPO / "configs" / recipe)
    code, out, err = run(capsys, "train", path, "--dry-run")
    assert (code, err) == (0, "")
    assert yaml.safe_load(out) == yaml.safe_load(to_yaml(load_config(path)))
    printed = yaml.safe_load(out)["trainer"]
    assert printed["nnodes"] * printed["n_gpus_per_node"] == RECIPES[recipe]
    # The same under torchrun at the intended size: rank 0 prints, the others stay silent.
    monkeypatch.setenv("WORLD_SIZE", str(RECIPES[recipe]))
    monkeypatch.setenv("RANK", "0")
    assert run(capsys, "train", path, "--dry-run")[:2] == (0, out)
    monkeypatch.setenv("RANK", "1")
    assert run(capsys, "train", path, "--dry-run") == (0, "", "")


def test_recipe_purposes():
    def layout(recipe: str):
        cfg = load_config(str(REPO / "configs" / recipe))
        m = cfg.actor_rollout_ref.actor.megatron
        return (cfg.algorithm.adv_estimator, cfg.critic.enable, m.tensor_model_parallel_size,
                m.pipeline_model_parallel_size, cfg.actor_rollout_ref.rollout.name)

    assert layout("demo_cpu.yaml") == ("gae", True, 2, 1, "cpu")
    assert layout("countdown_qwen2.5_3b_ppo.yaml") == ("gae", True, 2, 1, "sglang")
    assert layout("gsm8k_qwen2.5_7b_grpo.yaml") == ("grpo", False, 2, 1, "sglang")
    assert layout("qwen2.5_32b_4node.yaml") == ("grpo", False, 8, 4, "sglang")
    assert layout("qwen3_30b_a3b_grpo.yaml") == ("grpo", False, 2, 1, "sglang")
    moe = load_config(str(REPO / "configs/qwen3_30b_a3b_grpo.yaml")).actor_rollout_ref.actor.megatron
    assert (moe.expert_model_parallel_size, moe.sequence_parallel, moe.use_distributed_optimizer) == (8, True, True)
    assert layout("qwen2_5_7b_grpo_32k_cp.yaml") == ("grpo", False, 2, 1, "sglang")
    long = load_config(str(REPO / "configs/qwen2_5_7b_grpo_32k_cp.yaml"))
    assert long.actor_rollout_ref.actor.megatron.context_parallel_size == 4
    assert long.data.max_prompt_length + long.data.max_response_length == 32768
    assert layout("qwen2_5_7b_grpo_lora.yaml") == ("grpo", False, 1, 1, "sglang")
    lora = load_config(str(REPO / "configs/qwen2_5_7b_grpo_lora.yaml")).actor_rollout_ref
    assert 32 <= lora.model.lora.rank <= 64 and lora.actor.use_kl_loss  # the reference: the base, adapters off


def test_dry_run_applies_overrides_in_any_position(capsys):
    code, out, _ = run(capsys, "train", str(REPO / "configs/demo_cpu.yaml"), "trainer.seed=7", "--dry-run",
                       "data.train_batch_size=64")
    assert code == 0
    printed = yaml.safe_load(out)
    assert printed["trainer"]["seed"] == 7 and printed["data"]["train_batch_size"] == 64
    assert printed["data"]["seed"] == 7  # inherited values are printed resolved


def test_dry_run_without_a_file_prints_the_defaults(capsys):
    code, out, _ = run(capsys, "train", "--dry-run")
    assert code == 0 and yaml.safe_load(out) == yaml.safe_load(to_yaml(load_config(None)))


@pytest.fixture
def run_dir(tmp_path, monkeypatch) -> Path:
    """A RUN_DIR for configs/demo_cpu.yaml whose inputs pass the start-up checks: a model directory (a built-in
    model's config.json) and a data file name."""
    import json

    from mppo.plan import known_config

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(known_config("Qwen2.5-0.5B")[1]))
    monkeypatch.setenv("RUN_DIR", str(tmp_path))
    return tmp_path


def test_train_hands_the_config_to_the_trainer(capsys, monkeypatch, run_dir):
    received = []
    fake_module(monkeypatch, "mppo.trainer", run=lambda cfg: received.append(cfg) or 3)
    code, _, _ = run(capsys, "train", str(REPO / "configs/demo_cpu.yaml"), "trainer.seed=5")
    assert code == 3
    assert received == [load_config(str(REPO / "configs/demo_cpu.yaml"), ["trainer.seed=5"])]


def test_train_stops_on_a_missing_model_before_the_trainer_starts(capsys, monkeypatch, run_dir):
    """The start-up checks (mppo.preflight) run in `mppo train` itself: one line, the key and the fix."""
    fake_module(monkeypatch, "mppo.trainer", run=lambda cfg: pytest.fail("the trainer started"))
    code, out, err = run(capsys, "train", str(REPO / "configs/demo_cpu.yaml"),
                         f"actor_rollout_ref.model.path={run_dir}/nothing")
    assert code == 2 and out == ""
    assert err == (f"mppo: error: actor_rollout_ref.model.path='{run_dir}/nothing' does not exist; give an HF model "
                   "directory (config.json + safetensors), e.g. one written by `mppo convert` or save_pretrained\n")


def test_a_trainer_bug_keeps_its_traceback(capsys, monkeypatch, run_dir):
    def broken(cfg):
        raise RuntimeError("bug")

    fake_module(monkeypatch, "mppo.trainer", run=broken)
    with pytest.raises(RuntimeError, match="bug"):
        cli.main(["train", str(REPO / "configs/demo_cpu.yaml")])


@pytest.mark.parametrize("argv, message", [
    (["train", "trainer.sed=1", "--dry-run"], "unknown key 'trainer.sed' (override 'trainer.sed=1'); "
                                              "did you mean 'trainer.seed'?"),
    (["train", "no/such.yaml", "--dry-run"], "config file not found: no/such.yaml"),
    (["train", "critic.enable=false", "--dry-run"], "critic.enable = false: algorithm.adv_estimator = 'gae' needs"),
    # the trainer's one-layout rule (actor, critic and reference share megatron's groups), checked by --dry-run too
    (["train", "critic.megatron.pipeline_model_parallel_size=2", "--dry-run"],
     "critic.megatron.pipeline_model_parallel_size=2 differs from the actor's 1; mppo runs all models on one layout"),
    (["train", "a.yaml", "b.yaml"], "'b.yaml' is not a key=value override"),
])
def test_user_errors_are_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith("mppo: error: " + message) and err.count("\n") == 1


def test_world_size_from_torchrun_is_checked(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, _, err = run(capsys, "train", str(REPO / "configs/demo_cpu.yaml"), "--dry-run")
    assert code == 2 and "the launch has 4 ranks (WORLD_SIZE)" in err
    monkeypatch.setenv("RANK", "3")
    # the wait for rank 0 to say it: test_reliability_inputs.py::test_parallel_sizes_that_do_not_fit_under_torchrun
    monkeypatch.setattr(cli, "RANK0_GRACE_S", 0)
    assert run(capsys, "train", str(REPO / "configs/demo_cpu.yaml"), "--dry-run") == (2, "", "")  # rank 0 reports


def test_warnings_are_printed_once(capsys):
    code, _, err = run(capsys, "train", "actor_rollout_ref.rollout.val_kwargs.n=3", "--dry-run")
    assert code == 0 and err.count("mppo: warning:") == 1 and "identical greedy responses" in err


def test_help_and_unknown_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(name in out for name in ["train", *cli.TOOLS])
    assert run(capsys, "train", "--help")[0] == 0
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "invalid choice: 'frobnicate'" in err
    assert run(capsys)[0] == 2


# ---------------------------------------------------------------------------------------------------------- tools
@pytest.mark.parametrize("command", sorted(cli.TOOLS))
def test_tool_not_landed_yet(capsys, monkeypatch, command):
    module = cli.TOOLS[command][0].format(name="kernels")
    absent = "mppo.bench" if command == "bench" else module  # bench: the whole package is absent
    monkeypatch.setitem(sys.modules, absent, None)
    # The module itself too: under an editable install the parent may still resolve, and the real tool (a long
    # benchmark) must never run from this test.
    monkeypatch.setitem(sys.modules, module, None)
    argv = [command, "kernels"] if "{name}" in cli.TOOLS[command][0] else [command]
    code, _, err = run(capsys, *argv)
    assert code == 2 and "not available yet" in err and module in err


def test_unknown_benchmark_lists_the_available_ones(capsys, monkeypatch, tmp_path):
    (tmp_path / "alpha_beta.py").write_text("def main(argv):\n    return 0\n")
    fake_module(monkeypatch, "mppo.bench", __path__=[str(tmp_path)])
    code, _, err = run(capsys, "bench", "gamma")
    assert code == 2 and err == "mppo: error: unknown bench 'gamma'; available: alpha-beta\n"
    code, _, err = run(capsys, "bench")
    assert code == 2 and "usage: mppo bench NAME [ARGS...]; available: alpha-beta" in err


@pytest.mark.parametrize("command", sorted(cli.TOOLS))
def test_tool_gets_its_arguments(capsys, monkeypatch, command):
    calls = []
    module = cli.TOOLS[command][0].format(name="weight_sync")
    fake_module(monkeypatch, module, main=lambda argv: calls.append(argv) or 5)
    name = ["weight-sync"] if "{name}" in cli.TOOLS[command][0] else []
    assert cli.main([command, *name, "--out", "x", "a=b", "--help"]) == 5
    assert calls == [["--out", "x", "a=b", "--help"]]


def test_tool_user_error_and_bug(capsys, monkeypatch):
    from mppo.config import ConfigError

    def user_error(argv):
        raise ConfigError("--tp 3 does not divide 4 ranks; use 1, 2 or 4")

    fake_module(monkeypatch, "mppo.plan", main=user_error)
    code, _, err = run(capsys, "plan", "cfg.yaml")
    assert code == 2 and err == "mppo: error: --tp 3 does not divide 4 ranks; use 1, 2 or 4\n"

    def bug(argv):
        raise KeyError("bug")

    fake_module(monkeypatch, "mppo.plan", main=bug)
    with pytest.raises(KeyError):
        cli.main(["plan"])


def test_tool_missing_dependency_is_not_hidden(monkeypatch, tmp_path):
    (tmp_path / "mppo_fake_tool.py").write_text("import mppo_no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.TOOLS, "doctor", ("mppo_fake_tool", "test"))
    with pytest.raises(ModuleNotFoundError, match="mppo_no_such_dependency_xyz"):
        cli.main(["doctor"])


# ------------------------------------------------------------------------------------------------- real processes
def _python_m_mppo(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "mppo", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**clean, **(env or {})})


def test_python_m_mppo_dry_run_prints_the_resolved_config():
    done = _python_m_mppo("train", "configs/ppo_trainer.yaml", "--dry-run")
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed == yaml.safe_load(to_yaml(load_config(str(REPO / "configs/ppo_trainer.yaml"))))
    assert printed["critic"]["enable"] is True and printed["critic"]["ppo_mini_batch_size"] == 256


def test_python_m_mppo_user_error_has_no_traceback():
    done = _python_m_mppo("train", "configs/ppo_trainer.yaml", "actor_rollout_ref.actor.optim.lrr=1e-6")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("mppo: error: unknown key 'actor_rollout_ref.actor.optim.lrr' (override "
                           "'actor_rollout_ref.actor.optim.lrr=1e-6'); did you mean "
                           "'actor_rollout_ref.actor.optim.lr'?\n")


def test_torchrun_dry_run_prints_once():
    torchrun = Path(sys.executable).with_name("torchrun")
    clean = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "mppo", "train",
                           "configs/demo_cpu.yaml", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=clean)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("actor_rollout_ref:") == 1
    assert yaml.safe_load(done.stdout)["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] == 2


@pytest.mark.parametrize("exit_arg, code", [(None, 0), (0, 0), (4, 4), ("tool says no", 1)])
def test_tool_sys_exit_becomes_the_exit_code(capsys, monkeypatch, exit_arg, code):
    def exits(argv):
        sys.exit(exit_arg)

    fake_module(monkeypatch, "mppo.doctor", main=exits)
    assert cli.main(["doctor"]) == code
    if isinstance(exit_arg, str):
        assert capsys.readouterr().err == "tool says no\n"


def test_dry_run_appends_the_plan_when_the_model_config_is_at_hand(tmp_path, capsys):
    """`mppo train --dry-run` ends with `mppo plan`'s memory verdict (issue 9), or says why it could not plan."""
    import json

    from mppo.cli import main

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    assert main(["train", "configs/demo_cpu.yaml", f"actor_rollout_ref.model.path={model}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# verdict: FITS" in out
    assert main(["train", "configs/ppo_trainer.yaml", "--dry-run"]) == 0
    assert "# plan: not computed (actor_rollout_ref.model.path is null" in capsys.readouterr().out


def test_dry_run_rejects_a_model_the_trainer_cannot_map(tmp_path, capsys):
    """The trainer's start-up check of the model's config.json runs under --dry-run too (mppo.preflight): before,
    a dry run printed the config and `# plan: not computed`, and only `mppo train` stopped."""
    import json

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "vocab_size": 1000, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512}))
    code, out, err = run(capsys, "train", "configs/demo_cpu.yaml", f"actor_rollout_ref.model.path={model}",
                         "--dry-run")
    assert (code, out) == (2, "")
    assert err.startswith("mppo: error: ") and "gpt2" in err and err.count("\n") == 1
