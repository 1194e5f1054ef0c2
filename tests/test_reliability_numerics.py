"""Numerical faults and a misbehaving reward, in one real 1-rank run; then checkpoints of other runs refused; and a
reward function that always raises, in a second short run.

The run (`torchrun --nproc_per_node=1 -m mppo train ...`, 4 steps, max_consecutive_skips=2):
  - MPPO_FAULT=nan_loss at steps 1, 3 and 4: the actor's and critic's losses are NaN in those steps;
  - a custom reward function that raises on some samples;
  - data.max_prompt_length below some prompts' length with filter_overlong_prompts=true.
Expected: step 1 skipped and counted; step 2's rollout policy still equals the reference model exactly (the skipped
update left the weights alone); steps 3 and 4 skipped; the run stops after step 4 with a one-line message.
"""
from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest
from e2e_assets import tiny_overrides
from reliability_launch import mppo_traceback, read_metrics, session_assets, train

MAX_PROMPT = 303  # the test prompts have 301..305 tokens: some are dropped

RAISING_REWARD = '''
from mppo.rewards.countdown import compute_score as countdown


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if len(solution_str) % 3 == 0:
        raise ValueError("reward bug on purpose")
    return countdown(solution_str, ground_truth, **kwargs)
'''


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("numerics")
    assets = root / "assets"  # its own copy: a test swaps the model
    shutil.copytree(session_assets(tmp_path_factory), assets)
    (root / "reward.py").write_text(RAISING_REWARD)
    run_dir = root / "run"
    overrides = tiny_overrides(assets, run_dir, world=1, steps=4) + [
        f"data.max_prompt_length={MAX_PROMPT}", "data.filter_overlong_prompts=true",
        f"reward.custom_fn.path={root / 'reward.py'}", "reward.custom_fn.name=compute_score",
        "trainer.max_consecutive_skips=2", "trainer.val_before_train=false",
        "trainer.max_ckpt_to_keep=null"]  # keep every checkpoint: the test looks at which steps were written
    launch = train(overrides, world=1, env={"MPPO_FAULT": "nan_loss@step:1;nan_loss@step:3+"},
                   log=root / "nan_run.log")
    return launch, run_dir, assets, overrides


def test_nan_update_is_skipped_counted_and_leaves_weights(nan_run):
    launch, run_dir, _, _ = nan_run
    m = read_metrics(run_dir)
    assert sorted(m) == [1, 2, 3, 4], launch.output[-3000:]
    assert [m[s]["training/skipped_steps"] for s in (1, 2, 3, 4)] == [1, 1, 2, 3]
    assert [m[s]["actor/skipped"] for s in (1, 2, 3, 4)] == [1.0, 0.0, 1.0, 1.0]
    assert [m[s]["critic/skipped"] for s in (1, 2, 3, 4)] == [1.0, 0.0, 1.0, 1.0]
    assert m[1]["actor/pg_loss"] == "nan" and m[1]["critic/vf_loss"] == "nan"  # what the update saw
    assert m[2]["actor/pg_loss"] != "nan" and m[2]["actor/skipped_optimizer_steps"] == 0
    # The KL in the reward compares the rollout policy (old log-probs) with the frozen reference, i.e. the
    # initial weights: it is exactly 0 at step 2 only if step 1's update changed nothing; step 3 sees step 2's
    # update, which proves the metric notices a change.
    assert m[1]["actor/reward_kl_penalty"] == 0.0
    assert m[2]["actor/reward_kl_penalty"] == 0.0
    assert m[3]["actor/reward_kl_penalty"] != 0.0


def test_consecutive_nan_steps_stop_the_run_with_one_line(nan_run):
    launch, run_dir, _, _ = nan_run
    assert launch.returncode != 0
    assert 2 in launch.child_exit_codes()  # mppo's exit code for a problem the user can act on
    errors = launch.lines("mppo: error")
    assert len(errors) == 1, launch.output[-3000:]
    assert "stopped at step 4: 2 consecutive steps had a NaN/inf loss or grad norm" in errors[0]
    assert "trainer.max_consecutive_skips=2" in errors[0] and "Lower the learning rate" in errors[0]
    assert not mppo_traceback(launch.output)
    # Steps 1-3 were checkpointed; the failing step 4 was not.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*")) == [
        "global_step_1", "global_step_2", "global_step_3"]


def test_raising_reward_scores_zero_is_counted_and_logged_once(nan_run):
    launch, run_dir, _, _ = nan_run
    m = read_metrics(run_dir)
    errors = [m[s]["reward/errors"] for s in (1, 2, 3, 4)]
    assert sum(errors) > 0 and all(e <= 8 for e in errors)  # some of each step's 8 samples
    assert launch.output.count("reward function failed on a 'countdown' sample") == 1
    assert launch.output.count("ValueError: reward bug on purpose") == 1
    assert 4 in m  # and the run went on


def test_overlong_prompts_are_filtered_with_a_count(nan_run):
    launch, _, assets, _ = nan_run
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(assets / "model" / "tokenizer.json"))
    rows = pq.read_table(assets / "data" / "train.parquet").to_pylist()
    too_long = sum(len(tokenizer.encode(r["prompt"][0]["content"], add_special_tokens=False).ids) > MAX_PROMPT
                   for r in rows)
    assert 0 < too_long < len(rows)
    assert f"dropped {too_long} of {len(rows)} prompts longer than max_prompt_length={MAX_PROMPT}" in launch.output


def test_checkpoint_of_another_config_and_model_is_refused_naming_the_differences(nan_run, tmp_path):
    """The same command with one setting changed and another model (same path, other architecture) put in place."""
    _, run_dir, assets, overrides = nan_run
    before = sorted(p.name for p in run_dir.rglob("*"))
    model = assets / "model"
    saved = tmp_path / "model_backup"
    shutil.copytree(model, saved)
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"], config["intermediate_size"] = 48, 96
    (model / "config.json").write_text(json.dumps(config))
    try:
        launch = train(overrides + ["algorithm.gamma=0.9"], world=1, log=tmp_path / "other.log")
    finally:
        shutil.rmtree(model)
        shutil.copytree(saved, model)
    assert 2 in launch.child_exit_codes(), launch.output[-3000:]
    errors = launch.lines("mppo: error")
    assert len(errors) == 1 and not mppo_traceback(launch.output), launch.output[-3000:]
    message = errors[0]
    assert f"{run_dir / 'checkpoints' / 'global_step_3'} was written by a run with a different config" in message
    assert "algorithm.gamma: 1.0 (checkpoint) vs 0.9 (now)" in message
    assert "actor_rollout_ref.model.config_json.hidden_size: 32 (checkpoint) vs 48 (now)" in message
    assert "critic.model.config_json.intermediate_size: 64 (checkpoint) vs 96 (now)" in message
    assert "trainer.default_local_dir" in message  # the way out: a new run directory
    assert sorted(p.name for p in run_dir.rglob("*")) == before  # nothing written


ALWAYS_RAISING_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    raise KeyError("no field 'answer' in this reward on purpose")
'''


def test_a_reward_function_that_always_raises_stops_the_run_naming_it(tmp_path_factory, tmp_path):
    """Without reward.max_failed_steps the run trained on zero rewards to the end (exit 0); now it stops after
    2 steps in which every response failed to score, with one line naming the function and its last error, and
    the last good checkpoint (step 1) kept."""
    (tmp_path / "broken_reward.py").write_text(ALWAYS_RAISING_REWARD)
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(session_assets(tmp_path_factory), run_dir, world=1, steps=4) + [
        f"reward.custom_fn.path={tmp_path / 'broken_reward.py'}", "reward.max_failed_steps=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1"]
    launch = train(overrides, world=1, log=tmp_path / "broken_reward.log")
    assert 2 in launch.child_exit_codes(), launch.output[-3000:]
    errors = launch.lines("mppo: error")
    assert len(errors) == 1 and not mppo_traceback(launch.output), launch.output[-3000:]
    assert "stopped at step 2: the reward function" in errors[0]
    assert f"{tmp_path / 'broken_reward.py'}:compute_score" in errors[0]
    assert "failed on every response of 2 steps in a row (reward.max_failed_steps=2)" in errors[0]
    assert "KeyError: \"no field 'answer' in this reward on purpose\"" in errors[0]
    m = read_metrics(run_dir)
    assert sorted(m) == [1, 2] and [m[s]["reward/error_fraction"] for s in (1, 2)] == [1.0, 1.0]
    assert m[1]["reward/errors"] == 8.0  # every one of the step's 8 responses
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("global_step_*")) == ["global_step_1"]
