"""SFT examples: prompt ids + target response ids for `mppo sft` (mppo.sft's docstring gives the response format)
and the errors of an unusable row. Its own module so that mppo.sft_tool's multi-turn builder and mppo.sft share
it without importing each other."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from mppo.data import RLDataset
from mppo.errors import UserError

THINK_OPEN = "<think>"


class SFTError(UserError, ValueError):
    """The fine-tuning cannot run as asked; the message names the problem and the fix."""


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]  # prompt ids followed by response ids (EOS last)
    prompt_length: int
    # 1/0 per response token (after the prompt): 0 on tool turns (context, no loss; mppo.sft_tool); None: all 1
    loss_mask: tuple[int, ...] | None = None


def format_response(prompt: str, solution: str) -> str:
    """The target response for a prompt whose correct answer is `solution` (see the module docstring)."""
    think = "" if prompt.rstrip().endswith(THINK_OPEN) else " <think>"
    return f"{think} </think> <answer> {solution} </answer>"


OPERATORS = "+-*/"
_OPERATOR_RE = re.compile(r"(?<=\s)[-+*/](?=\s)")  # a binary operator as the tasks write it: " + "


def noisy_solution(solution: str, rng: random.Random) -> str:
    """`solution` with every binary operator replaced by one drawn uniformly from + - * / (numbers, their order
    and the parentheses stay): a plausible, well-formed answer that is right only by chance."""
    if not _OPERATOR_RE.search(solution):
        raise SFTError(f"--solution-noise rewrites the operators of an expression, but the solution {solution!r} has "
                       "none (e.g. a multiply task's product); use --solution-noise 0 for this task")
    return _OPERATOR_RE.sub(lambda _: rng.choice(OPERATORS), solution)


def build_examples(dataset: RLDataset, tokenizer: Any, max_response_length: int,
                   max_rows: int | None = None, solution_noise: float = 0.0,
                   seed: int = 0) -> list[SFTExample]:
    """prompt + target response ids for every row (the first `max_rows`), with clear errors for unusable rows.
    A seeded fraction `solution_noise` of the rows gets a noisy_solution instead of the correct one."""
    if tokenizer.eos_token_id is None:
        raise SFTError("the tokenizer has no EOS token; the response must end with one so that the model learns "
                       "to stop. Use a tokenizer with eos_token set (build_local_tokenizer sets <|endoftext|>)")
    count = len(dataset) if max_rows is None else min(max_rows, len(dataset))
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        item = dataset[i]
        solution = item.extra_info.get("solution")
        if isinstance(solution, int) and not isinstance(solution, bool):
            solution = str(solution)  # e.g. a product stored as a number
        if not isinstance(solution, str) or not solution.strip():
            raise SFTError(f"row {i} ({item.data_source}) has no extra_info.solution; SFT trains on the solutions "
                           "that `mppo data countdown|multiply` writes there, so generate the data with it or add "
                           "an 'extra_info': {'solution': '...'} to every row")
        if solution_noise and rng.random() < solution_noise:
            solution = noisy_solution(solution, rng)
        response = tokenizer(format_response(item.raw_prompt, solution), add_special_tokens=False)["input_ids"]
        response = list(response) + [tokenizer.eos_token_id]
        if len(response) > max_response_length:
            raise SFTError(f"row {i}'s target response is {len(response)} tokens (EOS included), more than "
                           f"max_response_length={max_response_length}; raise --max-response-length")
        examples.append(SFTExample(item.input_ids + response, len(item.input_ids)))
    return examples
