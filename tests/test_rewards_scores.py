"""Countdown, multiplication and GSM8K scorers on hand-made cases (including hostile answers), the registry and
loading a user's reward function from a file."""
from __future__ import annotations

import time

import pytest

from mppo.rewards import countdown, gsm8k, multiply
from mppo.rewards.registry import (
    RewardConfigError,
    default_compute_score,
    known_data_sources,
    load_custom_reward_fn,
    resolve_compute_score,
)

# A TinyZero-style base prompt, written out by hand; its example answer must never be scored.
PROMPT = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it.\n"
          "User: Using the numbers [3, 5, 7], create an equation that equals 22. Show your work in <think> </think> "
          "tags. And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
          "\nAssistant: Let me solve this step by step.\n<think>")
GT = {"target": 22, "numbers": [3, 5, 7]}


def cd(answer_line: str, ground_truth=GT, **kwargs) -> float:
    return countdown.compute_score(PROMPT + " 3 times 5 is 15 </think>\n" + answer_line, ground_truth, **kwargs)


@pytest.mark.parametrize("answer_line, expected", [
    ("<answer> 3 * 5 + 7 </answer>", 1.0),
    ("<answer>7+3*5</answer>", 1.0),
    ("<answer> (5 × 3) + 7 </answer>", 1.0),  # unicode times
    ("<answer> ((3 * 5) + (7)) </answer>", 1.0),
    ("<answer> 3 + 5 + 7 </answer>", 0.1),  # wrong result
    ("<answer> 3 * 5 + 7 + 7 </answer>", 0.1),  # a number reused
    ("<answer> 3 * 5 </answer>", 0.1),  # a number missing
    ("<answer> 3 * 5 + 7 + 0 </answer>", 0.1),  # a number not given
    ("<answer> 3 * 5 + 7.0 </answer>", 0.1),  # a decimal literal is not one of the integers given
    ("<answer> 22 </answer>", 0.1),
    ("<answer></answer>", 0.1),
    ("<answer> 3 * 5 + 7 = 22 </answer>", 0.1),
    ("<answer> 3 + 5 + 7 </answer> <answer> 3 * 5 + 7 </answer>", 1.0),  # the last tag counts
    ("<answer> 3 * 5 + 7 </answer> <answer> 3 + 5 + 7 </answer>", 0.1),
    ("no tags at all", 0.0),
    ("<answer> 3 * 5 + 7", 0.0),  # unclosed
    # hostile answers: well-formed tags, so the format score, computed without running anything
    ("<answer> 9**9**9 </answer>", 0.1),
    ("<answer> 3 ** 5 + 7 </answer>", 0.1),
    ("<answer> __import__('os').system('touch /tmp/pwned') </answer>", 0.1),
    ("<answer> x + y + z </answer>", 0.1),
    ("<answer> (3).__class__ </answer>", 0.1),
    ("<answer> 3 * 5 + 7; import os </answer>", 0.1),
    ("<answer> " + "(" * 200 + "3 * 5 + 7" + ")" * 200 + " </answer>", 0.1),  # nesting beyond the bound
    ("<answer> " + "3 * 5 + 7 + 0 * " * 700 + "1 </answer>", 0.1),  # ~10,000 characters
    ("<answer> 99999999999999999999999999999999 * 3 * 5 * 7 </answer>", 0.1),
    ("<answer> ３ * 5 + 7 </answer>", 0.1),  # full-width digit
])
def test_countdown_hand_made(answer_line, expected):
    assert cd(answer_line) == expected


def test_countdown_unicode_minus_and_division():
    assert cd("<answer> 5 × 7 − 3 </answer>", {"target": 32, "numbers": [3, 5, 7]}) == 1.0
    assert cd("<answer> 6 ÷ 3 × 4 </answer>", {"target": 8, "numbers": [6, 4, 3]}) == 1.0
    assert cd("<answer> 1 / 3 * 3 </answer>", {"target": 1, "numbers": [1, 3, 3]}) == 1.0  # within 1e-5
    assert cd("<answer> 7 + 5 - 5 </answer>", {"target": 7, "numbers": [5, 5, 7]}) == 1.0
    assert cd("<answer> 7 / (5 - 5) </answer>", {"target": 7, "numbers": [5, 5, 7]}) == 0.1  # division by zero


def test_countdown_text_location_rules():
    # Only the last line of the assistant's text is searched (TinyZero).
    assert cd("<answer> 3 * 5 + 7 </answer>\nHope that helps.") == 0.0
    # The prompt's example answer is before the marker: a response without an answer scores 0.
    assert cd("I give up.") == 0.0
    # No assistant marker at all: 0, as in TinyZero.
    assert countdown.compute_score("<answer> 3 * 5 + 7 </answer>", GT) == 0.0
    # The chat-template marker works as well.
    chat = "<|im_start|>user\nUse [3, 5, 7] to make 22<|im_end|>\n<|im_start|>assistant\n<answer> 3*5+7 </answer>"
    assert countdown.compute_score(chat, GT) == 1.0
    assert countdown.compute_score(chat + "<|im_end|>", GT) == 1.0


def test_countdown_scores_are_configurable_and_ground_truth_checked():
    assert cd("<answer> 3 + 5 + 7 </answer>", format_score=0.25) == 0.25
    assert cd("<answer> 3 * 5 + 7 </answer>", score=2.0) == 2.0
    assert cd("<answer> 3 * 5 + 7 </answer>", {"target": 22.0, "numbers": (7, 5, 3)}) == 1.0
    with pytest.raises(ValueError, match="countdown ground_truth"):
        cd("<answer> 1 </answer>", {"target": 22})


def test_hostile_countdown_answers_are_fast():
    lines = ["<answer> " + "9**" * 3000 + "9 </answer>", "<answer> " + "(" * 5000 + ")" * 5000 + " </answer>",
             "<answer> " + "1" * 10_000 + " </answer>", "<answer>" + "<answer>" * 3000 + "</answer>"]
    start = time.perf_counter()
    assert [cd(line) for line in lines] == [0.1, 0.1, 0.1, 0.1]
    assert time.perf_counter() - start < 0.5


MUL_PROMPT = ("A conversation between User and Assistant. ... i.e., <think> reasoning process here </think> "
              "<answer> answer here </answer>. User: Calculate the following equation: 123 * 456 = Assistant:")


@pytest.mark.parametrize("response, expected", [
    (" <think> 123*456 </think> <answer> 56088 </answer>", 1.0),
    (" <answer>56,088</answer>", 1.0),
    (" <answer> 56 088 </answer>", 1.0),
    (" <answer> 56089 </answer>", 0.05),
    (" <answer> 56088.0 </answer>", 0.05),
    (" <answer> -56088 </answer>", 0.05),
    (" <answer> 123 * 456 </answer>", 0.05),  # an expression is not the product
    (" <answer> 1 </answer> <answer> 56088 </answer>", 1.0),
    (" <answer> " + "9" * 10_000 + " </answer>", 0.05),  # beyond Python's int() digit limit: no crash
    (" I think it is 56088", 0.0),  # the prompt's example tag is not the model's answer
])
def test_multiply_hand_made(response, expected):
    assert multiply.compute_score(MUL_PROMPT + response, 56088) == expected


def test_multiply_ground_truth_forms_and_no_marker():
    assert multiply.compute_score("<answer>56088</answer>", "56088") == 1.0
    assert multiply.compute_score("<answer>56088</answer>", 56088, format_score=0.0, score=3.0) == 3.0
    with pytest.raises(ValueError, match="multiply ground_truth"):
        multiply.compute_score("<answer>1</answer>", "many")


@pytest.mark.parametrize("text, method, expected", [
    ("so she has 72 apples.\n#### 72", "strict", 1.0),
    ("#### 1,234", "strict", 1.0),
    ("#### $72", "strict", 0.0),  # no number right after '#### '
    ("#### 5 then #### 72", "strict", 0.5),  # strict takes the first one
    ("The answer is 72", "strict", 0.0),
    ("The answer is 72", "flexible", 1.0),
    ("12 then 72", "flexible", 1.0),
    ("First 72, then 5", "flexible", 0.5),
    ("no numbers here", "flexible", 0.0),
])
def test_gsm8k(text, method, expected):
    gt = "1234" if "1,234" in text else "72"
    assert gsm8k.compute_score(text, gt, method=method, format_score=0.5) == expected


def test_gsm8k_ignores_the_question_before_the_assistant_marker():
    question = "User: Natalia sold 48 clips in April and half as many in May. How many in total?\nAssistant:"
    assert gsm8k.compute_score(question + " I am not sure.", "72", method="flexible", format_score=0.5) == 0.0
    assert gsm8k.compute_score(question + " 48 + 24 = 72\n#### 72", "72") == 1.0
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 1", "1", method="loose")


def test_registry_selects_by_data_source():
    line = PROMPT + "</think>\n<answer> 3 * 5 + 7 </answer>"
    assert default_compute_score("countdown", line, GT) == 1.0
    assert default_compute_score("countdown", line.replace("3 * 5", "3 + 5"), GT, format_score=0.3) == 0.3
    assert default_compute_score("multiply", "Assistant: <answer>6</answer>", 6, extra_info={"index": 0}) == 1.0
    assert default_compute_score("openai/gsm8k", "#### 6", "6") == 1.0
    assert {"countdown", "multiply", "gsm8k", "openai/gsm8k"} <= set(known_data_sources())
    with pytest.raises(RewardConfigError, match=r"'lighteval/MATH'.*countdown.*reward.custom_fn"):
        default_compute_score("lighteval/MATH", "x", "1")


def test_custom_reward_function_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("HELPER = 3\n"
                    "def length_reward(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(len(solution_str)) + ground_truth\n")
    fn = load_custom_reward_fn(str(path), "length_reward")
    assert fn(data_source="anything", solution_str="abcd", ground_truth=1) == 5.0
    assert resolve_compute_score(str(path), "length_reward")("x", "ab", 0) == 2.0
    assert resolve_compute_score(None, None) is default_compute_score
    assert resolve_compute_score("", "") is default_compute_score
    assert resolve_compute_score(None, "compute_score") is default_compute_score  # the config's default name

    with pytest.raises(RewardConfigError, match=r"missing\.py.*does not exist"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "length_reward")
    with pytest.raises(RewardConfigError, match=r"my_reward\.py.*no attribute 'score_fn'.*length_reward"):
        load_custom_reward_fn(str(path), "score_fn")
    with pytest.raises(RewardConfigError, match="HELPER.*not a function|not a function"):
        load_custom_reward_fn(str(path), "HELPER")
    with pytest.raises(RewardConfigError, match="name is empty"):
        resolve_compute_score(str(path), None)
    broken = tmp_path / "broken.py"
    broken.write_text("import this_module_does_not_exist\n")
    with pytest.raises(RewardConfigError, match=r"broken\.py.*ModuleNotFoundError"):
        load_custom_reward_fn(str(broken), "f")
    not_py = tmp_path / "reward.txt"
    not_py.write_text("def f(**kw): return 1\n")
    with pytest.raises(RewardConfigError, match="not a .py file"):
        load_custom_reward_fn(str(not_py), "f")
