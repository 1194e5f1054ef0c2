"""TinyZero's multiplication reward (`verl/utils/reward_score/multiply.py`).

The last `<answer>…</answer>` in the assistant text: none → 0, equal to the product → `score`, anything else →
`format_score` (TinyZero's default 0.05). With `style="natural"` (see mppo.rewards.answer) a response without
tags is scored by its last number instead ("7 * 8 = 56." → 56); no number → 0.

Deliberate differences from TinyZero: the answer is compared as an integer (commas and spaces ignored), where
TinyZero compared the answer string with the ground truth as stored, an int after a parquet round trip, so it
never matched; and the text before the assistant marker (the prompt) is not searched, so the prompt's example
`<answer> answer here </answer>` is never taken for the model's answer. Without a marker the whole text is used.
"""
from __future__ import annotations

import re
from typing import Any

from mppo.rewards.answer import assistant_text, check_style, last_answer_tag, last_number, natural_text

# Products of the generated operands have at most a few dozen digits; longer answers are wrong, and capping
# them keeps int() away from Python's 4300-digit conversion limit.
MAX_ANSWER_DIGITS = 64
_INTEGER = re.compile(r"-?\d{1,%d}" % MAX_ANSWER_DIGITS)


def extract_solution(solution_str: str, style: str = "rule") -> str | None:
    if check_style(style) == "natural":
        text = natural_text(solution_str)
        tagged = last_answer_tag(text, across_lines=True)
        return last_number(text if tagged is None else tagged)
    text = assistant_text(solution_str)
    return last_answer_tag(solution_str if text is None else text)


def _read_ground_truth(ground_truth: Any) -> int:
    try:
        return int(str(ground_truth).replace(",", "").strip())
    except ValueError as err:
        raise ValueError(f"multiply ground_truth must be an integer, got {ground_truth!r}") from err


def compute_score(solution_str: str, ground_truth: Any, format_score: float = 0.05, score: float = 1.0,
                  style: str = "rule") -> float:
    expected = _read_ground_truth(ground_truth)
    answer = extract_solution(solution_str, style)
    if answer is None:
        return 0.0
    normalized = answer.replace(",", "").replace(" ", "")
    if _INTEGER.fullmatch(normalized) and int(normalized) == expected:
        return score
    return format_score
