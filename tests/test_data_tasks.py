"""Generated TinyZero tasks: solvable, distinct, seeded, in veRL's exact parquet row format, via `mppo data`."""
from __future__ import annotations

import itertools
import os
import re
from fractions import Fraction

import pyarrow.parquet as pq
import pytest

from mppo.data.cli import main as data_main
from mppo.data.tasks import (
    TaskGenerationError,
    countdown_prompt,
    generate_countdown,
    generate_multiply,
    multiply_prompt,
    write_task,
)
from mppo.rewards import countdown as countdown_reward
from mppo.rewards import multiply as multiply_reward

# TinyZero's templates (examples/data_preprocess/countdown.py), written out by hand for numbers [1, 2, 3], target 6.
TINYZERO_BASE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer.\n"
    "User: Using the numbers [1, 2, 3], create an equation that equals 6. You can use basic arithmetic operations "
    "(+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. And return the "
    "final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>.\n"
    "Assistant: Let me solve this step by step.\n<think>")
TINYZERO_INSTRUCT = (
    "<|im_start|>system\nYou are a helpful assistant. You first thinks about the reasoning process in the mind and "
    "then provides the user with the answer.<|im_end|>\n<|im_start|>user\n Using the numbers [1, 2, 3], create an "
    "equation that equals 6. You can use basic arithmetic operations (+, -, *, /) and each number can only be used "
    "once. Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags, for "
    "example <answer> (1 + 2) / 3 </answer>.<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n"
    "<think>")


def test_prompts_are_tinyzeros():
    assert countdown_prompt(6, [1, 2, 3], "base") == TINYZERO_BASE
    assert countdown_prompt(6, (1, 2, 3), "qwen-instruct") == TINYZERO_INSTRUCT
    assert multiply_prompt(12, 34).endswith("User: Calculate the following equation: 12 * 34 = Assistant:")
    assert "<|im_start|>assistant\n" in multiply_prompt(12, 34, "qwen-instruct")
    with pytest.raises(TaskGenerationError, match="template"):
        countdown_prompt(6, [1, 2, 3], "llama")


def _reachable(numbers: tuple[int, ...]) -> set[Fraction]:
    """Every value reachable with + - * / using each number exactly once (brute force, independent of mppo)."""
    if len(numbers) == 1:
        return {Fraction(numbers[0])}
    values: set[Fraction] = set()
    for size in range(1, len(numbers)):
        for left in itertools.combinations(range(len(numbers)), size):
            right = tuple(numbers[i] for i in range(len(numbers)) if i not in left)
            for a in _reachable(tuple(numbers[i] for i in left)):
                for b in _reachable(right):
                    values.update({a + b, a - b, a * b})
                    if b != 0:
                        values.add(a / b)
    return values


def test_countdown_problems_are_solvable_and_their_solution_scores_full():
    problems = generate_countdown(300, num_operands=(3, 4), min_number=1, max_number=100, max_target=1000, seed=3)
    assert len({(p.target, tuple(sorted(p.numbers))) for p in problems}) == 300
    assert {len(p.numbers) for p in problems} == {3, 4}
    for p in problems:
        assert 1 <= p.target <= 1000 and all(1 <= n <= 100 for n in p.numbers)
        # The solution is digits, operators and parentheses only, built by the generator: safe to eval here.
        assert re.fullmatch(r"[0-9+\-*/() ]+", p.solution)
        assert sorted(int(n) for n in re.findall(r"\d+", p.solution)) == sorted(p.numbers)
        assert eval(p.solution, {"__builtins__": {}}, {}) == p.target
        response = f" ok </think>\n<answer> {p.solution} </answer>"
        gt = {"target": p.target, "numbers": list(p.numbers)}
        assert countdown_reward.compute_score(countdown_prompt(p.target, p.numbers) + response, gt) == 1.0
    for p in problems[:25]:  # an exhaustive search agrees that each is solvable
        assert Fraction(p.target) in _reachable(p.numbers)


def test_generation_is_seeded():
    assert generate_countdown(50, seed=7) == generate_countdown(50, seed=7)
    assert generate_countdown(50, seed=7) != generate_countdown(50, seed=8)
    assert generate_multiply(50, digits=3, seed=7) == generate_multiply(50, digits=3, seed=7)


def test_impossible_requests_are_refused_clearly():
    with pytest.raises(TaskGenerationError, match="distinct multiplication problems.*--digits"):
        generate_multiply(200, digits=1)  # only 100 pairs exist
    with pytest.raises(TaskGenerationError, match="distinct countdown problems.*--max-number"):
        generate_countdown(500, num_operands=2, min_number=1, max_number=3)
    with pytest.raises(TaskGenerationError, match="num_operands"):
        generate_countdown(5, num_operands=1)


def test_parquet_rows_have_verl_format(tmp_path):
    train, test = write_task("countdown", tmp_path, train_size=40, test_size=10, seed=1)
    assert (train, test) == (os.path.join(tmp_path, "train.parquet"), os.path.join(tmp_path, "test.parquet"))
    table = pq.read_table(train)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    test_rows = pq.read_table(test).to_pylist()
    assert len(rows) == 40 and len(test_rows) == 10
    problems = generate_countdown(50, seed=1)  # the same draw, split 40 / 10
    p = problems[0]
    assert rows[0] == {
        "data_source": "countdown",
        "prompt": [{"role": "user", "content": countdown_prompt(p.target, p.numbers)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": p.target, "numbers": list(p.numbers)}},
        "extra_info": {"split": "train", "index": 0, "solution": p.solution},
    }
    assert [r["extra_info"]["index"] for r in test_rows] == list(range(10))
    assert {r["extra_info"]["split"] for r in test_rows} == {"test"}
    def key(row):
        gt = row["reward_model"]["ground_truth"]
        return gt["target"], tuple(sorted(gt["numbers"]))

    assert not {key(r) for r in rows} & {key(r) for r in test_rows}

    write_task("multiply", tmp_path / "mul", train_size=8, test_size=2, seed=1, digits=2)
    mul = pq.read_table(tmp_path / "mul" / "train.parquet").to_pylist()
    for row in mul:
        a, b = map(int, re.search(r"(\d+) \* (\d+)", row["prompt"][0]["content"]).groups())
        assert row["data_source"] == "multiply" and row["reward_model"]["ground_truth"] == a * b
        answer = f"{row['prompt'][0]['content']} <answer> {row['extra_info']['solution']} </answer>"
        assert multiply_reward.compute_score(answer, row["reward_model"]["ground_truth"]) == 1.0


def test_write_replaces_files_whole(tmp_path):
    (tmp_path / "train.parquet").write_text("old")
    write_task("multiply", tmp_path, train_size=5, test_size=5, digits=2)
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 5
    assert sorted(os.listdir(tmp_path)) == ["test.parquet", "train.parquet"]  # no temporary files left


def test_cli(tmp_path, capsys):
    out = tmp_path / "cd"
    assert data_main(["countdown", "--out", str(out), "--num-operands", "3-4", "--train-size", "20",
                      "--test-size", "5", "--seed", "2", "--template", "qwen-instruct"]) == 0
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert len(rows) == 20 and rows[0]["prompt"][0]["content"].startswith("<|im_start|>system")
    assert data_main(["multiply", "--out", str(tmp_path / "m"), "--digits", "2", "--train-size", "6",
                      "--test-size", "2"]) == 0
    assert pq.read_table(tmp_path / "m" / "test.parquet").num_rows == 2
    assert data_main(["multiply", "--out", str(tmp_path / "x"), "--digits", "1", "--train-size", "150"]) == 2
    assert "--digits" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")
    with pytest.raises(SystemExit):
        data_main(["countdown", "--out", str(out), "--template", "llama"])
    with pytest.raises(SystemExit):
        data_main(["countdown", "--out", str(out), "--num-operands", "three"])


def test_short_template_keeps_the_question_and_the_reward():
    """The short template is the question alone plus the assistant turn; a correct answer still scores 1.0 and a
    well-formed wrong one the format score, with the rewards' own parsing."""
    assert countdown_prompt(6, [1, 2, 3], "short") == (
        "User: Using the numbers [1, 2, 3], create an equation that equals 6.\nAssistant: <think>")
    assert multiply_prompt(12, 34, "short") == "User: Calculate 12 * 34.\nAssistant: <think>"
    gt = {"target": 6, "numbers": [1, 2, 3]}
    prompt = countdown_prompt(6, [1, 2, 3], "short")
    assert countdown_reward.compute_score(prompt + " </think> <answer> 1 + 2 + 3 </answer>", gt) == 1.0
    assert countdown_reward.compute_score(prompt + " </think> <answer> 1 * 2 + 3 </answer>", gt) == 0.1
    assert multiply_reward.compute_score(multiply_prompt(12, 34, "short") + " </think> <answer> 408 </answer>",
                                         408) == 1.0


def test_tool_template_tells_the_calculator_call_format():
    """The tool template's example call is one the multi-turn rollout's parser reads and the calculator answers."""
    from mppo.data.tasks import countdown_prompt, reward_style
    from mppo.rollout.tools import parse_tool_calls, run_tool_call

    prompt = countdown_prompt(10, [2, 3, 4], "tool")
    assert prompt.startswith(countdown_prompt(10, [2, 3, 4], "chat"))
    (call,) = parse_tool_calls(prompt)
    assert call.name == "calculator" and not call.error
    assert run_tool_call(call, timeout_s=5, max_chars=64) == "9"
    assert reward_style("tool") == "natural"
