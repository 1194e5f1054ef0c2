"""Bad input: each case is the real `mppo train` command and must end with exit code 2 and ONE line naming the
problem and the fix, no traceback, and no run directory (nothing half written). The checks run before megatron
is imported, so each case costs a couple of seconds; two run at a time."""
from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from e2e_assets import tiny_overrides
from reliability_launch import mppo_traceback, session_assets, train


def _write_rows(path: Path, rows: list[dict], schema: pa.Schema) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """name → (launch arguments, phrases the one error line must contain)."""
    root = tmp_path_factory.mktemp("inputs")
    assets = session_assets(tmp_path_factory)
    table = pq.read_table(assets / "data" / "train.parquet")
    rows, schema = table.to_pylist(), table.schema
    no_prompt = [dict(r) for r in rows]
    no_prompt[3]["prompt"] = None
    no_truth = [dict(r) for r in rows]
    no_truth[5]["reward_model"] = {"style": "rule", "ground_truth": None}
    unknown_source = [dict(r, data_source="os.system") for r in rows]
    (root / "garbage.parquet").write_bytes(b"this is not parquet\n" * 10)
    small_vocab = root / "small_vocab_model"
    shutil.copytree(assets / "model", small_vocab)
    config = json.loads((small_vocab / "config.json").read_text())
    config["vocab_size"] = 100
    (small_vocab / "config.json").write_text(json.dumps(config))
    moe_configs = {"shared_expert_model": dict(shared_expert_intermediate_size=64),
                   "three_expert_model": dict(num_experts=3)}
    for name, change in moe_configs.items():  # Qwen3-MoE variants of the tiny model's config
        shutil.copytree(assets / "model", root / name)
        moe = {**json.loads((assets / "model" / "config.json").read_text()), "model_type": "qwen3_moe",
               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, **change}
        (root / name / "config.json").write_text(json.dumps(moe))
    files = {"missing": root / "missing" / "train.parquet", "garbage": root / "garbage.parquet",
             "no_prompt": _write_rows(root / "no_prompt.parquet", no_prompt, schema),
             "no_truth": _write_rows(root / "no_truth.parquet", no_truth, schema),
             "empty": _write_rows(root / "empty.parquet", [], schema),
             "unknown_source": _write_rows(root / "unknown_source.parquet", unknown_source, schema)}
    train_file = {key: f"data.train_files={path}" for key, path in files.items()}
    cases = {
        "missing data file": ([train_file["missing"]], ["data file", "missing/train.parquet", "does not exist",
                                                        "mppo data countdown --out DIR"]),
        "unreadable data file": ([train_file["garbage"]], ["cannot read data file", "garbage.parquet", "as parquet"]),
        "row without prompt": ([train_file["no_prompt"]], ["row 3 of", "no_prompt.parquet", "has no 'prompt'",
                                                           "every row needs a prompt"]),
        "row without ground truth": ([train_file["no_truth"]], ["row 5 of", "no_truth.parquet",
                                                               "reward_model.ground_truth"]),
        "empty dataset": ([train_file["empty"]], ["empty.parquet", "has no rows", "mppo data countdown"]),
        "overlong prompts refused": (["data.max_prompt_length=303", "data.filter_overlong_prompts=false"],
                                     ["prompts are longer than max_prompt_length=303", "the first in row",
                                      "set data.filter_overlong_prompts=true"]),
        "unknown data source": ([train_file["unknown_source"]], ["no built-in reward for data_source ['os.system']",
                                                  "set reward.custom_fn.path"]),
        "missing custom reward file": ([f"reward.custom_fn.path={root / 'nope.py'}"],
                                       ["reward.custom_fn.path", "nope.py", "does not exist"]),
        "vocabulary mismatch": ([f"actor_rollout_ref.model.path={small_vocab}"],
                                ["the tokenizer has 320 tokens", "has vocab_size 100", "tokenizer_path"]),
        "sequence beyond the model's positions": (["data.max_response_length=200"],
                                                  ["data.max_prompt_length + data.max_response_length = 400 + 200",
                                                   "max_position_embeddings = 512", "actor_rollout_ref.model.path=",
                                                   "lower data.max_response_length to at most 112"]),
        "Transformer Engine on CPU": (["actor_rollout_ref.model.transformer_impl=te"],
                                      ["transformer_impl", "Transformer Engine needs CUDA", "transformer_impl=local"]),
        "Transformer Engine missing": (["actor_rollout_ref.model.transformer_impl=te", "trainer.device=cuda"],
                                       ["needs Transformer Engine", "pip install mppo[gpu]"]),
        # SGLang missing or of a wrong version: tests/test_rollout_factory.py (make test installs SGLang's CPU tier,
        # so there the package is hidden from the version lookup)
        "unsupported MoE variant": ([f"actor_rollout_ref.model.path={root / 'shared_expert_model'}"],
                                    ["config.json has shared_expert_intermediate_size=64", "not supported",
                                     "remove shared_expert_intermediate_size"]),
        "expert parallel size that does not divide the experts": (
            ["env:WORLD_SIZE=2", "env:RANK=0", "trainer.n_gpus_per_node=2",
             f"actor_rollout_ref.model.path={root / 'three_expert_model'}",
             "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"],
            ["actor_rollout_ref.actor.megatron.expert_model_parallel_size = 2", "does not divide the 3 experts",
             "use a divisor of 3"]),
        "bad MPPO_FAULT": (["env:MPPO_FAULT=explode@step:1"], ["MPPO_FAULT='explode@step:1'", "kill|hang|nan_loss"]),
        # rank 0 of a 2-rank launch, as torchrun would start it (the torchrun test below has the launcher's race)
        "parallel sizes that do not fit": (["env:WORLD_SIZE=2", "env:RANK=0", "trainer.n_gpus_per_node=2",
                                            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"],
                                           ["TP x PP = 4 x 1 = 4 does not divide the world size 2",
                                            "choose tensor/pipeline sizes whose product divides 2"]),
    }
    return assets, root, cases


def _run_case(assets: Path, root: Path, name: str, args: list[str]):
    run_dir = root / name.replace(" ", "_")
    env = dict(a.removeprefix("env:").split("=", 1) for a in args if a.startswith("env:"))
    overrides = tiny_overrides(assets, run_dir, world=1) + [a for a in args if not a.startswith("env:")]
    return run_dir, train(overrides, world=None, env=env, timeout=120, log=root / f"{run_dir.name}.log")


def test_bad_inputs_stop_with_one_line_naming_problem_and_fix(cases):
    assets, root, table = cases
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(table, pool.map(lambda item: _run_case(assets, root, *item),
                                           [(name, args) for name, (args, _) in table.items()])))
    for name, (_, phrases) in table.items():
        run_dir, launch = results[name]
        errors = launch.lines("mppo: error")
        assert launch.returncode == 2, (name, launch.output[-3000:])
        assert len(errors) == 1 and len(launch.output.strip().splitlines()) <= 3, (name, launch.output[-3000:])
        assert "Traceback" not in launch.output and not mppo_traceback(launch.output), (name, launch.output)
        for phrase in phrases:
            assert phrase in errors[0], (name, phrase, errors[0])
        assert not run_dir.exists(), (name, sorted(run_dir.rglob("*")))


def test_parallel_sizes_that_do_not_fit_under_torchrun(tmp_path_factory, tmp_path):
    """The same mistake under torchrun: the launch stops with exit code 2, ONE error line (rank 0's: the other rank
    waits for it instead of racing it out, mppo/cli.py) and nothing written."""
    assets = session_assets(tmp_path_factory)
    launch = train(tiny_overrides(assets, tmp_path / "run", world=2, tp=4), world=2, timeout=120,
                   log=tmp_path / "layout.log")
    assert launch.returncode != 0 and 2 in launch.child_exit_codes(), launch.output[-3000:]
    assert not mppo_traceback(launch.output), launch.output[-3000:]
    errors = launch.lines("mppo: error")
    assert len(errors) == 1, launch.output[-3000:]
    assert "TP x PP = 4 x 1 = 4 does not divide the world size 2" in errors[0]
    assert not (tmp_path / "run").exists()
