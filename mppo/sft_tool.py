"""Multi-turn SFT demonstrations that call the calculator (`mppo sft --tool-fraction P`, issue 16): a warm-up that
gives a small instruct model a non-zero rate of hermes tool calls, so that multi-turn GRPO has calls to reinforce.

A tool demonstration for a countdown row with solution S and target T is the conversation the RL agent loop
(mppo.rollout.agent_loop) would produce:

    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "S"}}</tool_call>
    tool       calculator(S)                    (= T; rendered by the tokenizer's chat template, with the next
                                                 assistant header: agent_loop.tool_turn_ids)
    assistant  S = T, so <answer> S </answer><eos>

A multiply row ("What is a * b?", `mppo data multiply --template tool`) is demonstrated with one call of
`a * b` and the answer copied from its result: the calculator does the arithmetic a small model gets wrong.

With `retry_fraction`, a seeded fraction of the tool demonstrations first calls a wrong candidate (S with random
operators, mppo.sft.noisy_solution), reads its real result R != T from the calculator, writes "R is not T." and
calls S: the demonstrations show the tool being used to check an answer, not only to echo it.
The other rows (1 - tool_fraction) answer directly, " <think> </think> <answer> S </answer>", noisy with
`solution_noise` as in mppo.sft: without the tool the warm-up model is right only part of the time.

Every tool turn's tokens are context only: loss 0 (the agent loop's `loss_mask` holes), like the prompt.
Each assistant segment is tokenized on its own and the tool-turn ids are appended between them, the same token
boundaries the agent loop builds from generated ids.
"""
from __future__ import annotations

import json
import random
from typing import Any

from mppo.data import RLDataset
from mppo.rollout.agent_loop import tool_turn_ids
from mppo.rollout.tools import calculator
from mppo.sft_examples import SFTError, SFTExample, format_response, noisy_solution

__all__ = ["tool_call_text", "tool_demonstration", "build_tool_examples"]


def tool_call_text(expression: str) -> str:
    """The hermes call of the calculator on `expression`, as mppo.rollout.tools.parse_tool_calls reads it."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def tool_demonstration(tokenizer: Any, prompt_ids: list[int], calls: list[str], answer: str,
                       target: int) -> SFTExample:
    """prompt + one assistant turn per calculator call (each followed by the tool's real output as a tool turn,
    loss 0) + the final answer turn ending in EOS (loss 1). Between calls the model states the miss ("R is not T.")."""
    if not calls:
        raise SFTError("a tool demonstration needs at least one calculator call")
    ids = list(prompt_ids)
    mask: list[int] = []
    previous = None

    def model_turn(text: str) -> None:
        turn = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.extend(turn)
        mask.extend([1] * len(turn))

    for expression in calls:
        model_turn((f"{previous} is not {target}. " if previous is not None else "") + tool_call_text(expression))
        result = calculator(expression)
        turn = tool_turn_ids(tokenizer, [result])
        ids.extend(turn)
        mask.extend([0] * len(turn))
        previous = result
    model_turn(f"{calls[-1]} = {previous}, so <answer> {answer} </answer>")
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    return SFTExample(ids, len(prompt_ids), tuple(mask))


def _tool_task(item: Any, row: int) -> tuple[str, str, int]:
    """(the expression a demonstration's calculator call computes, the answer, the target) of a countdown or
    multiply row."""
    extra, truth = item.extra_info, item.ground_truth
    if item.data_source == "countdown" and isinstance(extra.get("solution"), str) and isinstance(truth, dict):
        return extra["solution"], extra["solution"], int(truth["target"])
    if item.data_source == "multiply" and isinstance(extra.get("expression"), str):
        return extra["expression"], str(truth), int(truth)
    raise SFTError(f"row {row} ({item.data_source}) is neither a countdown row with extra_info.solution nor a "
                   "multiply row with extra_info.expression; tool demonstrations are written for `mppo data "
                   "countdown|multiply --template tool` rows")


def build_tool_examples(dataset: RLDataset, tokenizer: Any, max_response_length: int, *, tool_fraction: float,
                        retry_fraction: float = 0.0, max_rows: int | None = None, solution_noise: float = 0.0,
                        seed: int = 0) -> list[SFTExample]:
    """A seeded `tool_fraction` of the (first `max_rows`) countdown or multiply rows as tool demonstrations
    (`retry_fraction` of those with a wrong first call: countdown only), the rest as direct answers
    (`solution_noise` of them noisy: countdown only)."""
    if tokenizer.eos_token_id is None:
        raise SFTError("the tokenizer has no EOS token; the demonstrations must end with one")
    for name, value in (("tool_fraction", tool_fraction), ("retry_fraction", retry_fraction)):
        if not 0.0 <= value <= 1.0:
            raise SFTError(f"{name} is a fraction in [0, 1], got {value}")
    rng = random.Random(seed)
    count = len(dataset) if max_rows is None else min(max_rows, len(dataset))
    examples = []
    for i in range(count):
        item = dataset[i]
        call, answer, target = _tool_task(item, i)
        if item.data_source == "multiply" and retry_fraction:
            raise SFTError("--tool-retry-fraction is for countdown rows (a wrong candidate to check); a multiply "
                           "demonstration makes one call: use --tool-retry-fraction 0")
        if item.data_source == "multiply" and solution_noise:
            raise SFTError("--solution-noise rewrites the operators of an expression, but a multiply row's answer "
                           "is a product: use --solution-noise 0 for this task")
        if rng.random() < tool_fraction:
            calls = [call]
            if rng.random() < retry_fraction:
                wrong = noisy_solution(call, rng)
                if calculator(wrong) != calculator(call):
                    calls.insert(0, wrong)
            example = tool_demonstration(tokenizer, item.input_ids, calls, answer, target)
        else:
            if solution_noise and rng.random() < solution_noise:
                answer = noisy_solution(answer, rng)
            response = list(tokenizer(format_response(item.raw_prompt, answer), add_special_tokens=False)["input_ids"])
            example = SFTExample(item.input_ids + response + [tokenizer.eos_token_id], len(item.input_ids))
        length = len(example.input_ids) - example.prompt_length
        if length > max_response_length:
            raise SFTError(f"row {i}'s demonstration is {length} response tokens, more than "
                           f"max_response_length={max_response_length}; raise --max-response-length")
        examples.append(example)
    return examples
