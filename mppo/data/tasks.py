"""TinyZero-style tasks generated locally with a seed (countdown, multiplication), and GSM8K from local files.

Rows use veRL/TinyZero's parquet format:

    data_source   "countdown" | "multiply" | "openai/gsm8k"
    prompt        [{"role": "user", "content": <the templated prompt text>}]
    ability       "math"
    reward_model  {"style": "rule" | "natural",
                   "ground_truth": {"target": int, "numbers": [int, ...]} | int (the product) | str (GSM8K)}
    extra_info    {"split": "train" | "test", "index": int, "solution": str}

Templates: "base" and "qwen-instruct" are TinyZero's (the answer in `<answer>` tags, style "rule"); "short" keeps
the question and the assistant turn of "base" (tiny models on CPU); "chat" is the plain question as a user message
for instruct models: the tokenizer's own chat template is applied when the prompts are tokenized (RLDataset
does so when the tokenizer has one), and the rows' reward style is "natural" (mppo.rewards.answer: the model's
own way of answering is scored, `<answer>` tags or not); "tool" is "chat" plus how to call the calculator of
multi-turn rollouts (a hermes `<tool_call>` example), also scored in the natural style.

`extra_info.solution` is an answer that earns the full score (a countdown expression, or the product): handy for
a supervised warm-up and for checking the data.
"""
from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mppo.errors import UserError

# base and qwen-instruct are TinyZero's two prompt styles; short keeps only the question and the assistant turn
# (same reward, same answer format) so that tiny models on CPU see ~25-token prompts instead of ~130 (the CPU demo).
TEMPLATES = ("base", "qwen-instruct", "short", "chat", "tool")

# TinyZero's countdown prompt (examples/data_preprocess/countdown.py); its reward looks for "Assistant:" or
# "<|im_start|>assistant" and the <answer> tags.
_COUNTDOWN_TASK = ("Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
                   "arithmetic operations (+, -, *, /) and each number can only be used once. Show your work in "
                   "<think> </think> tags. And return the final answer in <answer> </answer> tags, for example "
                   "<answer> (1 + 2) / 3 </answer>.")
_BASE_PREAMBLE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves "
                  "it. The assistant first thinks about the reasoning process in the mind and then provides the "
                  "user with the answer.")
_INSTRUCT_SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. You first thinks about the reasoning process "
                    "in the mind and then provides the user with the answer.<|im_end|>\n")
_MULTIPLY_BASE = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves "
                  "it. The assistant first thinks about the reasoning process in the mind and then provides the "
                  "user with the answer. The reasoning process and answer are enclosed within <think> </think> and "
                  "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> "
                  "answer here </answer>. User: Calculate the following equation: {a} * {b} = Assistant:")
# The "chat" template: a plain question; the tokenizer's chat template wraps it.
_COUNTDOWN_CHAT = ("Using the numbers {numbers}, create an equation that equals {target}. Use +, -, * or / and "
                   "each number exactly once.")
_MULTIPLY_CHAT = "What is {a} * {b}? Answer with a number."
# The "tool" template: the chat question plus how to call the calculator of multi-turn rollouts
# (actor_rollout_ref.rollout.multi_turn, mppo.rollout.tools) in the hermes format. It is told in the user text
# because small instruct models' chat templates (SmolLM2's) take no `tools=`.
_TOOL_HINT = (" You may use a calculator: write <tool_call>{{\"name\": \"calculator\", \"arguments\": "
              "{{\"expression\": \"{example}\"}}}}</tool_call> and its result comes back. Give your final "
              "answer in <answer> </answer> tags.")
_MULTIPLY_TASK = ("Calculate {a} * {b}. Show your work in <think> </think> tags. And return the final answer in "
                  "<answer> </answer> tags, for example <answer> 1234 </answer>.")


class TaskGenerationError(UserError, ValueError):
    """The requested task data cannot be generated with these settings."""


@dataclass(frozen=True)
class CountdownProblem:
    target: int
    numbers: tuple[int, ...]
    solution: str  # an expression using each number once that equals target


@dataclass(frozen=True)
class MultiplyProblem:
    a: int
    b: int

    @property
    def product(self) -> int:
        return self.a * self.b


def _check_template(template: str) -> None:
    if template not in TEMPLATES:
        raise TaskGenerationError(f"unknown template {template!r}; choose one of {TEMPLATES}")


def countdown_prompt(target: int, numbers: list[int] | tuple[int, ...], template: str = "base") -> str:
    _check_template(template)
    task = _COUNTDOWN_TASK.format(numbers=list(numbers), target=target)
    if template == "chat":
        return _COUNTDOWN_CHAT.format(numbers=list(numbers), target=target)
    if template == "tool":
        example = " + ".join(str(n) for n in numbers)
        return _COUNTDOWN_CHAT.format(numbers=list(numbers), target=target) + _TOOL_HINT.format(example=example)
    if template == "base":
        return f"{_BASE_PREAMBLE}\nUser: {task}\nAssistant: Let me solve this step by step.\n<think>"
    if template == "short":
        return f"User: Using the numbers {list(numbers)}, create an equation that equals {target}.\nAssistant: <think>"
    return (f"{_INSTRUCT_SYSTEM}<|im_start|>user\n {task}<|im_end|>\n<|im_start|>assistant\n"
            "Let me solve this step by step.\n<think>")


def multiply_prompt(a: int, b: int, template: str = "base") -> str:
    _check_template(template)
    if template == "chat":
        return _MULTIPLY_CHAT.format(a=a, b=b)
    if template == "tool":
        return _MULTIPLY_CHAT.format(a=a, b=b) + _TOOL_HINT.format(example=f"{a} * {b}")
    if template == "base":
        return _MULTIPLY_BASE.format(a=a, b=b)
    if template == "short":
        return f"User: Calculate {a} * {b}.\nAssistant: <think>"
    return (f"{_INSTRUCT_SYSTEM}<|im_start|>user\n{_MULTIPLY_TASK.format(a=a, b=b)}<|im_end|>\n"
            "<|im_start|>assistant\nLet me solve this step by step.\n<think>")


def _random_solution(rng: random.Random, numbers: list[int]) -> tuple[int, str]:
    """Combine the numbers pairwise with random operations until one value is left (all values stay positive
    integers, so the expression is exact); return that value and the expression."""
    pool = [(n, str(n)) for n in numbers]
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        (a, expr_a), (b, expr_b) = pool[i], pool[j]
        options = [("+", a + b), ("*", a * b)]
        if a > b:
            options.append(("-", a - b))
        if a % b == 0:
            options.append(("/", a // b))
        op, value = rng.choice(options)
        pool = [item for k, item in enumerate(pool) if k not in (i, j)]
        pool.append((value, f"({expr_a} {op} {expr_b})"))
    value, expr = pool[0]
    return value, expr[1:-1] if len(numbers) > 1 else expr


def _unique(count: int, draw: Callable[[], Any], key: Callable[[Any], Any], what: str, hint: str) -> list[Any]:
    """`count` draws with distinct keys, so no test problem also appears in train."""
    seen: set[Any] = set()
    items: list[Any] = []
    attempts, max_attempts = 0, 50 * count + 10_000
    while len(items) < count:
        if attempts >= max_attempts:
            raise TaskGenerationError(f"found only {len(items)} distinct {what} after {attempts} attempts, "
                                      f"{count} requested; {hint}")
        attempts += 1
        item = draw()
        if item is None or key(item) in seen:
            continue
        seen.add(key(item))
        items.append(item)
    return items


def generate_countdown(count: int, *, num_operands: int | tuple[int, int] = 3, min_number: int = 1,
                       max_number: int = 100, max_target: int = 1000, seed: int = 0) -> list[CountdownProblem]:
    """`count` distinct solvable problems; `num_operands` is a count or an inclusive (low, high) range."""
    low, high = (num_operands, num_operands) if isinstance(num_operands, int) else num_operands
    if not 2 <= low <= high:
        raise TaskGenerationError(f"num_operands must be at least 2 (a range low <= high), got {num_operands}")
    if not 1 <= min_number <= max_number:
        raise TaskGenerationError(f"need 1 <= min_number <= max_number, got {min_number}, {max_number}")
    if max_target < 1:
        raise TaskGenerationError(f"max_target must be positive, got {max_target}")
    rng = random.Random(seed)

    def draw() -> CountdownProblem | None:
        numbers = [rng.randint(min_number, max_number) for _ in range(rng.randint(low, high))]
        target, solution = _random_solution(rng, numbers)
        return CountdownProblem(target, tuple(numbers), solution) if 1 <= target <= max_target else None

    return _unique(count, draw, lambda p: (p.target, tuple(sorted(p.numbers))), "countdown problems",
                   "raise --max-number, --max-target or --num-operands, or ask for fewer samples")


def generate_multiply(count: int, *, digits: int | tuple[int, int] = 3, seed: int = 0) -> list[MultiplyProblem]:
    """`count` distinct pairs of operands with at most `digits` digits each (TinyZero: 0 .. 10**digits - 1), or
    at most A digits for the first and B for the second with digits=(A, B)."""
    digits_a, digits_b = (digits, digits) if isinstance(digits, int) else digits
    if digits_a < 1 or digits_b < 1:
        raise TaskGenerationError(f"digits must be at least 1, got {digits}")
    rng = random.Random(seed)
    top_a, top_b = 10 ** digits_a - 1, 10 ** digits_b - 1
    return _unique(count, lambda: MultiplyProblem(rng.randint(0, top_a), rng.randint(0, top_b)),
                   lambda p: (p.a, p.b), "multiplication problems",
                   f"at most {(top_a + 1) * (top_b + 1)} exist; raise --digits or ask for fewer samples")


def reward_style(template: str) -> str:
    """The reward style of rows written with `template`: "natural" for chat and tool, TinyZero's "rule" otherwise."""
    return "natural" if template in ("chat", "tool") else "rule"


def _row(data_source: str, prompt: str, ground_truth: Any, split: str, index: int, solution: str,
         template: str) -> dict[str, Any]:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": prompt}],
        "ability": "math",
        "reward_model": {"style": reward_style(template), "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "solution": solution},
    }


def countdown_rows(problems: list[CountdownProblem], split: str, template: str = "base") -> list[dict[str, Any]]:
    return [_row("countdown", countdown_prompt(p.target, p.numbers, template),
                 {"target": p.target, "numbers": list(p.numbers)}, split, i, p.solution, template)
            for i, p in enumerate(problems)]


def multiply_rows(problems: list[MultiplyProblem], split: str, template: str = "base") -> list[dict[str, Any]]:
    rows = [_row("multiply", multiply_prompt(p.a, p.b, template), p.product, split, i, str(p.product), template)
            for i, p in enumerate(problems)]
    for row, p in zip(rows, problems):  # what a calculator call computes (mppo.sft_tool's demonstrations)
        row["extra_info"]["expression"] = f"{p.a} * {p.b}"
    return rows


def write_parquet(rows: list[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write rows atomically: a crash leaves either the old file or the complete new one, never half of one."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".parquet")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_task(task: str, out_dir: str | os.PathLike[str], *, train_size: int, test_size: int, seed: int = 0,
               template: str = "base", **task_options: Any) -> tuple[str, str]:
    """Generate `task` ("countdown" | "multiply") and write out_dir/train.parquet and out_dir/test.parquet.

    Train and test come from one draw of distinct problems, so they never share a problem.
    """
    _check_template(template)
    if train_size < 1 or test_size < 1:
        raise TaskGenerationError(f"need train_size >= 1 and test_size >= 1, got {train_size}, {test_size}")
    total = train_size + test_size
    if task == "countdown":
        problems: list[Any] = generate_countdown(total, seed=seed, **task_options)
        make_rows: Callable[..., list[dict[str, Any]]] = countdown_rows
    elif task == "multiply":
        problems = generate_multiply(total, seed=seed, **task_options)
        make_rows = multiply_rows
    else:
        raise TaskGenerationError(f"unknown task {task!r}; choose 'countdown' or 'multiply'")
    paths = (os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet"))
    write_parquet(make_rows(problems[:train_size], "train", template), paths[0])
    write_parquet(make_rows(problems[train_size:], "test", template), paths[1])
    return paths
