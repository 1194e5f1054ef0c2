"""DAPO's overlong shaping on hand cases (veRL 0.9.1 DAPO reward manager: expected_len = max_resp_len - buffer_len,
penalty = min(-(length - expected_len) / buffer_len * penalty_factor, 0)), truncation detection, and the trainer's
metrics of both in one short run."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from e2e_assets import dense_reward, make_assets, step_metrics, tiny_overrides
from test_trainer_e2e import train

from mppo.rewards.overlong import apply_overlong_penalty, overlong_penalty, truncated_responses


def test_penalty_matches_hand_cases():
    # max_resp_len 20, buffer 4: free up to 16 tokens, then -1/4 per token down to -factor at 20
    lengths = torch.tensor([0, 10, 16, 17, 18, 19, 20])
    got = overlong_penalty(lengths, max_resp_len=20, buffer_len=4, penalty_factor=1.0)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    got = overlong_penalty(torch.tensor([18, 20]), max_resp_len=20, buffer_len=4, penalty_factor=2.0)
    assert got.tolist() == [-1.0, -2.0]
    # the buffer is the whole length: every token costs factor / max_resp_len
    got = overlong_penalty(torch.tensor([1, 5, 8]), max_resp_len=8, buffer_len=8, penalty_factor=0.5)
    assert torch.allclose(got, torch.tensor([-1 / 16, -5 / 16, -0.5]))
    with pytest.raises(ValueError, match="buffer len"):
        overlong_penalty(lengths, max_resp_len=20, buffer_len=0, penalty_factor=1.0)


def test_penalty_goes_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    scores = torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 0.5], [0, 0, 0, 0]])
    shaped, penalty = apply_overlong_penalty(scores, mask, max_resp_len=4, buffer_len=2, penalty_factor=1.0)
    assert penalty.tolist() == [-0.5, -1.0, 0.0]
    assert shaped.tolist() == [[0, 0, 0.5, 0], [0, 0, 0, -0.5], [0, 0, 0, 0]]
    assert scores[0, 2] == 1.0  # the input is not modified


def test_truncated_means_full_length_without_a_stop_token():
    eos = 2
    responses = torch.tensor([[5, 6, 7], [5, 6, eos], [5, eos, 0], [5, 6, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0]])
    assert truncated_responses(responses, mask, max_response_length=3, stop_token_ids=[eos]).tolist() == [
        True, False, False, False]
    # rollout.ignore_eos: no stop tokens, every full-length response was cut
    assert truncated_responses(responses, mask, max_response_length=3, stop_token_ids=[]).tolist() == [
        True, True, False, False]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    return make_assets(tmp_path_factory.mktemp("assets"))


def test_mask_truncated_removes_cut_responses_from_the_mask():
    from mppo.config import load_config
    from mppo.workers.batch_schema import UNREJECTED_MASK
    from mppo.trainer.response_shaping import mask_truncated

    cfg = load_config(None, ["data.max_response_length=3", "algorithm.mask_truncated_responses=true"])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0]])
    full = {"responses": torch.tensor([[5, 6, 7], [5, 6, 2], [5, 2, 0]]), "response_mask": mask}
    metrics, changed = mask_truncated(cfg, full, stop_token_ids=[2])
    assert changed == ("response_mask",) and metrics == {"response_length/masked_truncated": 1.0}
    assert full["response_mask"].tolist() == [[0, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert full[UNREJECTED_MASK] is mask
    off = load_config(None, ["data.max_response_length=3"])
    assert mask_truncated(off, {"responses": full["responses"], "response_mask": mask}, [2]) == ({}, ())


def test_trainer_logs_the_penalty_and_keeps_a_batch_that_is_all_truncated(assets, tmp_path):
    """Buffer = the whole length (8), factor 100: each full-length response's penalty is -100, logged and in the
    training scores (the dense reward is in [0, 1.25)). Every response is full length (ignore_eos): masking them
    all would leave no token in the loss, so none is masked and the update is a normal, finite one."""
    run = tmp_path / "run"
    proc = train(1, tiny_overrides(assets, run, world=1, steps=1, estimator="grpo", n=2) + dense_reward(assets) + [
        "critic.enable=false", "algorithm.use_kl_in_reward=false", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "data.max_response_length=8", "reward.reward_kwargs.overlong_buffer_cfg.enable=true",
        "reward.reward_kwargs.overlong_buffer_cfg.len=8", "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=100",
        "reward.reward_kwargs.overlong_buffer_cfg.log=true", "algorithm.mask_truncated_responses=true",
        "actor_rollout_ref.rollout.ignore_eos=true", "trainer.n_gpus_per_node=1"])
    m = step_metrics(run)[1]
    assert m["response_length/mean"] == 8 and m["response_length/clip_ratio"] == 1.0
    assert m["reward/overlong_penalty/mean"] == pytest.approx(-100) and m["reward/overlong_ratio"] == 1.0
    assert -100 <= m["critic/score/min"] <= m["critic/score/max"] < -98.75
    assert m["response_length/masked_truncated"] == 0 and "none masked this step" in proc.stderr
    assert m["actor/skipped"] == 0 and m["actor/grad_norm"] > 0
