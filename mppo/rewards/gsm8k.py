"""GSM8K-style reward: the number after `#### ` (veRL `verl/utils/reward_score/gsm8k.py` semantics).

- strict: the first `#### <number>` in the assistant text (commas and `$` removed); none → 0.
- flexible: the last number anywhere in the assistant text (ignoring lone "."); none → 0.
The extracted string equal to the ground truth (as a string, commas removed) → `score`, otherwise `format_score`.

With `style="natural"` (see mppo.rewards.answer): the number in the last `<answer>` tag, else after the first
`#### `, else the last number of the assistant's text; compared as a number ("18.00", "$18" and "18" all match 18).

mppo's reward manager hands a scorer the prompt and the response together (TinyZero's convention), so the text
after the assistant marker is searched when there is one: the question's numbers are not the model's answer.
"""
from __future__ import annotations

import re
from typing import Any

from mppo.rewards.answer import assistant_text, check_style, last_answer_tag, last_number, natural_text

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in METHODS:
        raise ValueError(f"gsm8k extraction method must be one of {METHODS}, got {method!r}")
    text = assistant_text(solution_str)
    text = solution_str if text is None else text
    if method == "strict":
        match = _STRICT.search(text)
        return None if match is None else match.group(1).replace(",", "").replace("$", "")
    for candidate in reversed(_FLEXIBLE.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def natural_answer(solution_str: str) -> str | None:
    text = natural_text(solution_str)
    tagged = last_answer_tag(text, across_lines=True)
    if tagged is not None:
        return last_number(tagged)
    strict = _STRICT.search(text)
    return last_number(strict.group(1)) if strict else last_number(text)


def _same_number(answer: str, ground_truth: Any) -> bool:
    try:
        return abs(float(answer) - float(str(ground_truth).replace(",", "").replace("$", "").strip())) < 1e-6
    except ValueError:
        return False


def compute_score(solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0, style: str = "rule") -> float:
    if check_style(style) == "natural":
        answer = natural_answer(solution_str)
        if answer is None:
            return 0.0
        return score if _same_number(answer, ground_truth) else format_score
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).replace(",", "").strip() else format_score
