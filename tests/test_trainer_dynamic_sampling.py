"""DAPO dynamic sampling (algorithm.filter_groups): uniform groups are dropped, the batch is refilled from further
generation batches, and a run resumed across refilled steps continues bit-identically."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from e2e_assets import make_assets, step_metrics, tiny_overrides
from test_trainer_e2e import train

from mppo.trainer.dynamic_sampling import _concat, group_verdicts

# Prompts with an even countdown target score the constant 5 (their groups are uniform: no signal, filtered); the
# others get a score below 1.25 that differs between responses, so critic/score/max tells whether a uniform group
# was trained on.
UNIFORM = 5.0
REWARD = f'''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if int(ground_truth["target"]) % 2 == 0:
        return {UNIFORM}
    text = solution_str or ""
    return (sum(ch.isdigit() for ch in text) + 0.25 * len(set(text))) / (1.0 + len(text))
'''


def test_group_verdicts_keep_groups_with_signal_and_singletons():
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 3.0, 0.5, 0.5])
    uid = torch.tensor([7, 7, 3, 3, 9, 9, 4, 5, 5])
    kept, filtered = group_verdicts(metric, uid)
    # naive: a group is filtered iff it has > 1 row and max == min
    assert kept == [[2, 3], [6]] and filtered == [[0, 1], [4, 5], [7, 8]]
    kept, filtered = group_verdicts(torch.tensor([0.0, 0.0, 1.0, 0.0]), torch.tensor([1, 2, 1, 2]))
    assert kept == [[0, 2]] and filtered == [[1, 3]]  # groups need not be contiguous


def test_concat_left_pads_prompts_of_different_widths():
    def part(prompt: list[list[int]], response: list[list[int]]):
        ids = torch.tensor([p + r for p, r in zip(prompt, response)])
        prompt_mask = torch.tensor([[int(t != 0) for t in p] for p in prompt])
        attention = torch.cat([prompt_mask, torch.ones(len(prompt), len(response[0]), dtype=torch.long)], 1)
        return {"input_ids": ids, "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                "prompt_mask": prompt_mask, "responses": torch.tensor(response), "uid": torch.arange(len(prompt))}

    a = part([[0, 5, 6]], [[9, 8]])
    b = part([[7]], [[4, 3]])
    out = _concat([a, b], pad_token_id=0)
    assert out["input_ids"].tolist() == [[0, 5, 6, 9, 8], [0, 0, 7, 4, 3]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 0, 1, 2, 3], [0, 0, 0, 1, 2]]
    assert out["prompt_mask"].tolist() == [[0, 1, 1], [0, 0, 1]]
    assert out["responses"].tolist() == [[9, 8], [4, 3]] and out["uid"].tolist() == [0, 0]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = make_assets(tmp_path_factory.mktemp("assets"))
    (root / "uniform_half.py").write_text(REWARD)
    return root


def overrides(root: Path, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return tiny_overrides(root, run_dir, world=2, steps=steps, estimator="grpo", n=2) + [
        f"reward.custom_fn.path={root}/uniform_half.py", "critic.enable=false", "algorithm.use_kl_in_reward=false",
        "algorithm.filter_groups.enable=true", "data.gen_batch_size=8", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "data.max_response_length=8", *extra]


def test_uniform_groups_are_filtered_refilled_and_resume_is_exact(assets, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(2, overrides(assets, straight, 3))
    train(2, overrides(assets, resumed, 2))
    proc = train(2, overrides(assets, resumed, 3))
    assert "resumed from" in proc.stderr
    s, r = step_metrics(straight), step_metrics(resumed)
    for step in (1, 2, 3):
        m = s[step]
        # ~40% of the prompts have odd targets: one batch of 8 never keeps 8 groups
        assert m["train/num_gen_batches"] > 1, step
        assert m["train/filter_groups/filtered_groups"] > 0
        assert m["train/filter_groups/kept_groups"] >= 8 and m["train/filter_groups/filled_groups"] == 0
        assert m["critic/score/max"] < 1.25  # no uniform group in the trained batch
    for key, value in s[3].items():
        if not key.startswith(("timing_s/", "perf/")):
            assert r[3][key] == value, key


def test_generation_limit_fills_the_batch_with_a_warning(assets, tmp_path):
    run = tmp_path / "limited"
    proc = train(1, overrides(assets, run, 1, "algorithm.filter_groups.max_num_gen_batches=1",
                              "trainer.n_gpus_per_node=1"))
    m = step_metrics(run)[1]
    assert m["train/num_gen_batches"] == 1 and m["train/filter_groups/filled_groups"] > 0
    assert m["train/filter_groups/kept_groups"] + m["train/filter_groups/filled_groups"] == 8
    assert m["critic/score/max"] == UNIFORM and m["critic/score/min"] < 1.25  # kept groups first, then the fill
    assert "filtered groups fill the batch" in proc.stderr
