"""Finding the model's answer in a decoded prompt + response (TinyZero's conventions)."""
from __future__ import annotations

import re

# The prompt ends with one of these; what follows the first one is the assistant's text. Scoring only that part
# keeps the prompt's own example answer ("for example <answer> (1 + 2) / 3 </answer>") from being scored.
ASSISTANT_MARKERS = ("Assistant:", "<|im_start|>assistant")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>")


def assistant_text(solution_str: str) -> str | None:
    """The text after the first assistant marker (checked in ASSISTANT_MARKERS order), or None without one."""
    for marker in ASSISTANT_MARKERS:
        if marker in solution_str:
            return solution_str.split(marker, 1)[1]
    return None


def last_answer_tag(text: str) -> str | None:
    """The stripped content of the last `<answer>…</answer>` on a single line of `text`, or None."""
    matches = _ANSWER_TAG.findall(text)
    return matches[-1].strip() if matches else None
