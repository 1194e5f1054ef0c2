"""Multi-turn rollouts with tools in the trainer (issue 16 item 4), one torchrun launch of 2 ranks (DP 2: each
rank's rollout group runs the agent loop on its share, responses and loss masks gathered over the groups).

The policy is scripted (tests/scripted_engine.py, an engine of mppo's own interface): even conversations call the
calculator, get its answer as a tool turn, then answer; odd ones answer at once. Everything else is the trainer's
(random tiny Qwen2 actor and critic). The step's numbers are recomputed here by hand from the batch and from HF
transformers log-probs of the initial weights, with tool tokens left out (naive loops, not mppo's code):
GRPO advantages, the token-mean PG loss and entropy, the rollout-vs-actor probability metric, and (GAE case) the
returns of GAE run on each response's assistant tokens only, and the critic's value loss.
"""
from __future__ import annotations

import json
import math

import pytest

from dist_util import REPO, run_torchrun
from e2e_assets import DENSE_REWARD_FN, dense_reward, make_assets, tiny_overrides

GAMMA, LAM = 0.95, 0.9


def dense_score(text: str) -> float:
    namespace: dict = {}
    exec(DENSE_REWARD_FN, namespace)  # the run's reward function, as reward.custom_fn loads it
    return namespace["compute_score"]("countdown", text, None)


def masked_mean(values, masks) -> float:
    num = sum(v * m for row_v, row_m in zip(values, masks) for v, m in zip(row_v, row_m))
    return num / sum(m for row in masks for m in row)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from mppo.data import write_task

    root = make_assets(tmp_path_factory.mktemp("assets"), train_size=16, test_size=4)
    # chat-style rows: the tokenizer's chat template opens the assistant turn the script continues
    write_task("countdown", root / "data", train_size=16, test_size=4, seed=0, template="chat", num_operands=3,
               max_number=20, max_target=50)
    run = tmp_path_factory.mktemp("run")
    base = tiny_overrides(root, run / "grpo", world=2, n=2, estimator="grpo") + dense_reward(root) + [
        "actor_rollout_ref.rollout.multi_turn.enable=true", "data.max_response_length=160",
        "data.max_prompt_length=200",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.reuse_on_policy_log_prob=false",  # the old-log-prob pass runs: mismatch metrics
        "algorithm.use_kl_in_reward=false", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "critic.ppo_mini_batch_size=4", "critic.ppo_micro_batch_size_per_gpu=2",
        f"algorithm.gamma={GAMMA}", f"algorithm.lam={LAM}"]
    cases = {"grpo": base + ["critic.enable=false", f"trainer.rollout_data_dir={run}/grpo/rollouts"],
             "gae": [o.replace(f"{run}/grpo", f"{run}/gae") for o in base]
             + ["algorithm.adv_estimator=gae", "critic.enable=true"]}
    out = run_torchrun(REPO / "tests" / "dist" / "trainer_multi_turn.py", 2, run / "out",
                       ["--config", str(REPO / "configs" / "demo_cpu.yaml"), "--cases", json.dumps(cases)])
    return {**out[0], "group_of_two_ranks": [rank["group_of_two"] for rank in out], "run": run,
            "tokenizer": str(root / "model")}


def test_an_engine_group_of_two_ranks_shares_its_first_ranks_tool_messages(result):
    for rank in result["group_of_two_ranks"]:
        assert rank["texts"] == ["42"], rank  # rank 1's own run would have said otherwise
        assert rank["responses_equal"] and rank["num_responses"] == 6, rank
        assert rank["tool_calls"] == [1, 0] * 3, rank


def test_token_layout_assistant_tokens_in_the_mask_tool_tokens_out(result):
    for name in ("grpo", "gae"):
        case = result[name]
        rows = case["rows"]
        assert len(rows) == 8 and sorted(r["conversation"] % 2 for r in rows) == [0] * 4 + [1] * 4, name
        for row in rows:
            assert row["ids"] == row["expected_ids"], (name, row["conversation"])
            assert row["mask"] == row["expected_mask"], (name, row["conversation"])
            assert not any(row["mask_after"]), name
        calls = case["batch"]["num_tool_calls"]
        assert calls == [1 - r["conversation"] % 2 for r in rows], name
        assert case["metrics"]["multi_turn/tool_call_rate"] == 0.5, name


def test_rollout_data_dir_has_each_response_with_its_tool_turns_and_score(result):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(result["tokenizer"])
    case = result["grpo"]
    lines = [json.loads(line) for line in (result["run"] / "grpo" / "rollouts" / "1.jsonl").read_text().splitlines()]
    assert len(lines) == len(case["rows"]) == 8
    for line, row, uid, calls in zip(lines, case["rows"], case["batch"]["uid"], case["batch"]["num_tool_calls"]):
        assert line["output"] == tok.decode(row["expected_ids"], skip_special_tokens=False)
        assert line["input"] == tok.decode(tok(row["prompt_text"])["input_ids"], skip_special_tokens=False)
        assert line["score"] == pytest.approx(dense_score(row["prompt_text"] + row["assistant_text"]), rel=1e-6)
        assert (line["step"], line["uid"], line["num_tool_calls"]) == (1, uid, calls)
    assert "calculator" in lines[0]["output"] or "calculator" in lines[1]["output"]  # a tool turn's text is there
    assert not (result["run"] / "gae" / "rollouts").exists()  # off by default


def test_log_probs_and_rollout_metrics_leave_tool_tokens_out(result):
    case = result["grpo"]
    b = case["batch"]
    masks, hf = b["response_mask"], case["hf_log_probs"]
    worst = max(abs(o - h) for o_row, h_row, m_row in zip(b["old_log_probs"], hf, masks)
                for o, h, m in zip(o_row, h_row, m_row) if m)
    assert worst < 1e-4
    # training/rollout_probs_diff_max: |p_actor - p_rollout| over the model's tokens only
    diffs = [abs(math.exp(o) - math.exp(r)) for o_row, r_row, m_row in zip(b["old_log_probs"], b["rollout_log_probs"],
                                                                              masks) for o, r, m in zip(o_row, r_row, m_row) if m]
    assert case["metrics"]["training/rollout_probs_diff_max"] == pytest.approx(max(diffs), rel=1e-6)
    assert case["metrics"]["training/rollout_probs_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-6)
    # with the tool tokens in (engine log-prob 0: p = 1 against the actor's small p) the maximum would be ~1
    tool_diffs = [abs(math.exp(h) - 1.0) for h_row, m_row, row in zip(hf, masks, case["rows"])
                  for h, m in zip(h_row[:len(row["ids"])], m_row) if not m]
    assert tool_diffs and max(tool_diffs) > max(diffs) + 0.05


def test_the_step_loss_equals_the_batch_computed_by_hand(result):
    case = result["grpo"]
    b, rows, metrics = case["batch"], case["rows"], case["metrics"]
    masks = b["response_mask"]
    scores = [dense_score(r["prompt_text"] + r["assistant_text"]) for r in rows]
    assert [sum(s) for s in b["token_level_scores"]] == pytest.approx(scores, rel=1e-6)
    for row_scores, mask in zip(b["token_level_scores"], masks):  # the score sits on the last token in the loss
        last = max(t for t, m in enumerate(mask) if m)
        assert row_scores[last] != 0 and all(s == 0 for t, s in enumerate(row_scores) if t != last)
    # GRPO by hand: groups of n=2 rows of one prompt, unbiased std, eps 1e-6
    advantages = []
    for r in range(len(rows)):
        group = [scores[g] for g in range(len(rows)) if b["uid"][g] == b["uid"][r]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        advantages.append((scores[r] - mean) / (std + 1e-6))
    # on-policy first step: ratio 1, so the clipped PG loss is -A; token-mean over the model's tokens
    pg_hand = -masked_mean([[a] * len(m) for a, m in zip(advantages, masks)], masks)
    assert metrics["actor/pg_loss"] == pytest.approx(pg_hand, rel=1e-5, abs=1e-6)
    attended = [[1] * len(r["ids"]) + [0] * (len(masks[0]) - len(r["ids"])) for r in rows]
    pg_all_tokens = -masked_mean([[a] * len(m) for a, m in zip(advantages, masks)], attended)
    assert abs(pg_all_tokens - pg_hand) > 1e-3  # the check can tell tool tokens in from out
    val = [dense_score(prompt + text) for prompt, text in case["val_expected"]]
    assert len(val) == 4 and metrics["val/test_score/countdown"] == pytest.approx(sum(val) / len(val), rel=1e-6)
    entropy_hand = masked_mean(case["hf_entropy"], masks)
    assert metrics["actor/entropy"] == pytest.approx(entropy_hand, rel=1e-4)


def test_gae_skips_tool_tokens_and_the_value_loss_ignores_them(result):
    case = result["gae"]
    b, metrics = case["batch"], case["metrics"]
    for mask, rewards, values, returns in zip(b["response_mask"], b["token_level_rewards"], b["values"],
                                              b["returns"]):
        positions = [t for t, m in enumerate(mask) if m]
        assert all(values[t] == 0 for t, m in enumerate(mask) if not m)  # the critic's values are masked
        # GAE on the assistant tokens alone, as if the tool turns were not there
        adv, last, next_value = {}, 0.0, 0.0
        for t in reversed(positions):
            delta = rewards[t] + GAMMA * next_value - values[t]
            last = delta + GAMMA * LAM * last
            adv[t], next_value = last, values[t]
        for t in positions:
            assert returns[t] == pytest.approx(adv[t] + values[t], rel=1e-5, abs=1e-6)
    # first critic update, first mini-batch: predictions are the values, so the clipped loss is 0.5 (V - R)^2
    squared = [[(v - r) ** 2 for v, r in zip(vs, rs)] for vs, rs in zip(b["values"], b["returns"])]
    assert metrics["critic/vf_loss"] == pytest.approx(0.5 * masked_mean(squared, b["response_mask"]), rel=1e-4)
