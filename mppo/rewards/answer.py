"""Finding the model's answer in a decoded prompt + response.

Two reward styles (a row's `reward_model.style`, handed to the scorer as `extra_info["reward_style"]`):

- "rule" (TinyZero's conventions, the default): the answer is what the prompt asked for, inside
  `<answer>…</answer>` tags (countdown, multiply) or after `#### ` (GSM8K); anything else scores 0.
- "natural" (for instruct models asked a plain question in their own chat template, `mppo data ... --template
  chat`): the last `<answer>…</answer>` when the model wrote one, else the answer as the model writes it by
  itself: the last number of its text (multiply, GSM8K; GSM8K's `#### N` first) or the last arithmetic
  expression (countdown: "So 3 * 5 + 7 = 22." gives "3 * 5 + 7").

Only the assistant's text is searched (after ASSISTANT_MARKERS), so the question's own numbers and its example
answer are never taken for the model's answer.
"""
from __future__ import annotations

import re

from mppo.rewards.arith import MAX_EXPRESSION_CHARS, ParseError, parse_and_evaluate

# The prompt ends with one of these; what follows the first one is the assistant's text. Scoring only that part
# keeps the prompt's own example answer ("for example <answer> (1 + 2) / 3 </answer>") from being scored.
# ChatML (Qwen, SmolLM) and Llama 3 chat templates open the assistant's turn with the last two.
ASSISTANT_MARKERS = ("Assistant:", "<|im_start|>assistant", "<|start_header_id|>assistant")
REWARD_STYLES = ("rule", "natural")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>")
_ANSWER_TAG_ANY_LINE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# An integer or decimal, with optional thousands commas ("1,234"); "3, 5" is two numbers. Bounded length, so
# hostile output never reaches int()'s digit limit.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3}){1,10}|\d{1,64})(?:\.\d{1,32})?(?!\d)")
# Runs of characters an arithmetic expression is made of (the parser's alphabet); words and "=" split them.
_EXPRESSION_RUN = re.compile(r"[0-9.+\-*/×÷−() \t]+")
_HAS_OPERATOR = re.compile(r"[0-9)]\s*[+\-*/×÷−]\s*[-−(]*\s*[0-9(]")
MAX_CANDIDATES = 64  # expression runs tried per text, from the last backwards


def assistant_text(solution_str: str) -> str | None:
    """The text after the first assistant marker (checked in ASSISTANT_MARKERS order), or None without one."""
    for marker in ASSISTANT_MARKERS:
        if marker in solution_str:
            return solution_str.split(marker, 1)[1]
    return None


def last_answer_tag(text: str, *, across_lines: bool = False) -> str | None:
    """The stripped content of the last `<answer>…</answer>` in `text` (on one line unless across_lines), or None."""
    matches = (_ANSWER_TAG_ANY_LINE if across_lines else _ANSWER_TAG).findall(text)
    return matches[-1].strip() if matches else None


def check_style(style: str) -> str:
    if style not in REWARD_STYLES:
        raise ValueError(f"unknown reward style {style!r}; known styles: {REWARD_STYLES} (reward_model.style)")
    return style


def last_number(text: str) -> str | None:
    """The last number in `text`, commas removed and a sentence's final "." dropped ("1,234." → "1234")."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def last_expression(text: str) -> str | None:
    """The last arithmetic expression with at least one operator in `text` that parses, e.g. "3 * 5 + 7" in
    "So, 3 * 5 + 7 = 22." (a trailing sentence "." is dropped), or None."""
    runs = _EXPRESSION_RUN.findall(text[-64 * MAX_EXPRESSION_CHARS:])
    for run in reversed(runs[-MAX_CANDIDATES:]):
        candidate = run.strip().rstrip(".").strip()
        if not candidate or len(candidate) > MAX_EXPRESSION_CHARS or not _HAS_OPERATOR.search(candidate):
            continue
        try:
            parse_and_evaluate(candidate)
        except ParseError:
            continue
        return candidate
    return None


def natural_text(solution_str: str) -> str:
    """The assistant's text; "" without an assistant marker (the question's own numbers must not count, so a
    prompt the scorer cannot split from its response scores 0: use a chat template or an "Assistant:" turn)."""
    text = assistant_text(solution_str)
    return "" if text is None else text
