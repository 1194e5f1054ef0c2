"""DAPO dynamic sampling (algorithm.filter_groups): uniform groups are dropped, the batch is refilled from further
generation batches, and a run resumed across refilled steps continues bit-identically."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from e2e_assets import make_assets, step_metrics, tiny_overrides
from test_trainer_e2e import train

from mppo.config import load_config
from mppo.trainer.dynamic_sampling import FilterMetricError, _concat, group_verdicts

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


# Five groups of two responses: (score, acc, response length) each; the first response token names the row.
# With overlong_buffer len 4 of max_resp_len 8 a response of L tokens has penalty min(-(L - 4) / 4, 0).
ROWS = [(1.0, 1, 3), (0.9, 1, 3),  # same acc, scores differ
        (1.0, 1, 3), (0.0, 0, 3),  # everything differs
        (0.5, 0, 4), (0.5, 0, 6),  # same score and acc; the overlong penalty makes the rewards differ
        (0.5, 1, 2), (0.5, 1, 3),  # the same in every respect (no penalty up to 4 tokens)
        (1.0, 1, 6), (0.5, 0, 4)]  # scores differ; the penalty makes the rewards equal (0.5 and 0.5)


def _naive_kept(metric: str) -> set[int]:
    """The groups whose two values differ, by hand from ROWS."""
    def value(score, acc, length):
        return {"acc": acc, "score": score}.get(metric, score + min(-(length - 4) / 4, 0.0))
    return {g for g in range(len(ROWS) // 2) if value(*ROWS[2 * g]) != value(*ROWS[2 * g + 1])}


def _kept_by_sampler(metric: str, returns: str) -> set[int]:
    """The groups dynamic sampling keeps: the trainer's own reward step (PPOTrainer.train_reward, a real
    RewardManager and overlong shaping) on a one-rank stand-in, then DynamicSampler.collect."""
    from types import SimpleNamespace

    from mppo.rewards import RewardManager
    from mppo.trainer.dynamic_sampling import DynamicSampler
    from mppo.trainer.fit import PPOTrainer

    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                             "data.train_batch_size=5", "data.gen_batch_size=5", "algorithm.filter_groups.enable=true",
                             f"algorithm.filter_groups.metric={metric}", "reward.custom_fn.path=fn.py",
                             "data.max_response_length=8", "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                             "reward.reward_kwargs.overlong_buffer_cfg.len=4",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=5",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.n_gpus_per_node=1",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=1"], world_size=1)

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        score, acc, _ = ROWS[ord(solution_str[0]) - ord("a")]
        return {"score": score, "acc": bool(acc), "pred": "text is left out"} if returns == "dict" else score

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(chr(ord("a") + i) for i in ids))
    mask = torch.tensor([[1] * length + [0] * (8 - length) for _, _, length in ROWS])
    batch = {"responses": torch.arange(len(ROWS))[:, None].expand(-1, 8) * mask, "response_mask": mask,
             "uid": torch.arange(len(ROWS)) // 2, "prompt_mask": torch.ones(len(ROWS), 1, dtype=torch.long),
             "input_ids": torch.zeros(len(ROWS), 9, dtype=torch.long)}
    rows = SimpleNamespace(raw_prompts=[""] * len(ROWS), data_sources=["t"] * len(ROWS),
                           ground_truths=[None] * len(ROWS), extra_infos=[None] * len(ROWS))
    io = SimpleNamespace(is_leader=True, broadcast_from_leader=lambda obj: obj, dp_group=None,
                         dims=SimpleNamespace(dp_rank=0))
    trainer = SimpleNamespace(cfg=cfg, io=io, reward_inputs=[], data=SimpleNamespace(
        reward=RewardManager(tokenizer, compute_score)))
    trainer.reward = lambda *args: PPOTrainer.reward(trainer, *args)
    PPOTrainer.train_reward(trainer, batch, rows, None, 0)
    sampler = DynamicSampler(cfg, io, dataset_size=5, n=2, pad_token_id=0, generation_batch=None,
                             reward_name="fn.py:compute_score")
    out, metrics = sampler.collect(batch, None, step=1)
    kept_rows = 2 * int(metrics["train/filter_groups/kept_groups"])  # kept groups first, then the fill
    assert "filter_metric" not in out
    return set(out["uid"][:kept_rows].tolist())


def test_each_filter_metric_keeps_the_groups_a_hand_computation_keeps():
    expected = {"acc": {1, 4}, "score": {0, 1, 4}, "reward": {0, 1, 2}}
    for metric in ("acc", "score", "reward", "seq_reward", "seq_final_reward"):
        assert _naive_kept(metric) == expected.get(metric, expected["reward"]), metric  # the table is as meant
        assert _kept_by_sampler(metric, "dict") == _naive_kept(metric), metric
    # a function returning a number: that number is acc (veRL's DAPO reward manager), and there is no score
    assert _kept_by_sampler("acc", "number") == _naive_kept("score")
    with pytest.raises(FilterMetricError) as info:
        _kept_by_sampler("score", "number")
    assert str(info.value) == (
        "algorithm.filter_groups.metric=score: fn.py:compute_score returned no 'score' for 10 of 10 responses (a "
        "number it returns counts as 'acc'; a dict return gives its numeric keys); return a dict with 'score' from it "
        "(veRL's form: {'score': ..., 'acc': ...}), or set algorithm.filter_groups.metric=reward (the summed score)")


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
    # metric=acc: the function returns numbers, which are acc (the extra info path of a real run; same groups)
    proc = train(1, overrides(assets, run, 1, "algorithm.filter_groups.max_num_gen_batches=1",
                              "trainer.n_gpus_per_node=1", "algorithm.filter_groups.metric=acc"))
    m = step_metrics(run)[1]
    assert m["train/num_gen_batches"] == 1 and m["train/filter_groups/filled_groups"] > 0
    assert m["train/filter_groups/kept_groups"] + m["train/filter_groups/filled_groups"] == 8
    assert m["critic/score/max"] == UNIFORM and m["critic/score/min"] < 1.25  # kept groups first, then the fill
    assert "filtered groups fill the batch" in proc.stderr
