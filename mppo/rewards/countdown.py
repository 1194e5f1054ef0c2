"""TinyZero's countdown reward, evaluated with mppo's bounded arithmetic parser instead of `eval`.

Semantics (TinyZero `verl/utils/reward_score/countdown.py`): take the text after the assistant marker, keep its
last line, take the last `<answer>…</answer>` on it. No marker or no answer → 0. An answer that does not use each
given number exactly once, does not parse, divides by zero, or misses the target → `format_score`. An answer
within 1e-5 of the target → `score`.

Deliberate differences from TinyZero: `×`, `÷` and `−` are accepted as operators (the parser's alphabet), and the
numbers used are the expression's literals (TinyZero regex-matches digit runs, so it reads `1.5` as 1 and 5).

With `style="natural"` (see mppo.rewards.answer) the equation is the last `<answer>` anywhere in the assistant's
text, else its last arithmetic expression ("(3 * 5) + 7 = 22" gives "(3 * 5) + 7"); none → 0, and the rest as above.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mppo.rewards.answer import assistant_text, check_style, last_answer_tag, last_expression, natural_text
from mppo.rewards.arith import ParseError, parse_and_evaluate

TOLERANCE = 1e-5


def extract_solution(solution_str: str, style: str = "rule") -> str | None:
    """The equation in the last `<answer>` tag on the assistant text's last line ("rule"), or the last tag or
    expression anywhere in the assistant's text ("natural"); None when there is none."""
    if check_style(style) == "natural":
        text = natural_text(solution_str)
        tagged = last_answer_tag(text, across_lines=True)
        return tagged if tagged is not None else last_expression(text)
    text = assistant_text(solution_str)
    if text is None:
        return None
    return last_answer_tag(text.split("\n")[-1])


def _read_ground_truth(ground_truth: Mapping[str, Any]) -> tuple[int, list[int]]:
    try:
        target = int(ground_truth["target"])
        numbers = sorted(int(n) for n in ground_truth["numbers"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"countdown ground_truth must be {{'target': int, 'numbers': [int, ...]}}, "
                         f"got {ground_truth!r}") from err
    return target, numbers


def compute_score(solution_str: str, ground_truth: Mapping[str, Any], format_score: float = 0.1,
                  score: float = 1.0, style: str = "rule") -> float:
    target, numbers = _read_ground_truth(ground_truth)
    equation = extract_solution(solution_str, style)
    if equation is None:
        return 0.0
    try:
        result = parse_and_evaluate(equation)
    except ParseError:
        return format_score
    used = result.literals
    if not all(isinstance(n, int) for n in used) or sorted(used) != numbers:
        return format_score
    return score if abs(result.value - target) < TOLERANCE else format_score
