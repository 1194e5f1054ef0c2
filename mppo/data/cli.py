"""`mppo data countdown|multiply --out DIR ...`: write a generated task's train/test parquet files.

`mppo data gsm8k --train-file FILE [--test-file FILE] --out DIR`: GSM8K from local parquet files (no download).
All three take `--template chat` for instruct models: the plain question, in the tokenizer's own chat template when
tokenized, scored in the "natural" reward style (mppo.rewards.answer).

`mppo data tokenizer --data DIR --out DIR`: train a small local tokenizer on a task's texts (prompts and
solutions), for tiny models that start from scratch (the CPU demo); no download.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mppo.data.gsm8k import GSM8K_TEMPLATES, write_gsm8k
from mppo.data.tasks import TEMPLATES, TaskGenerationError, write_task


def _operand_range(text: str) -> int | tuple[int, int]:
    """"3" → 3, "3-4" → (3, 4) (each problem draws its operand count from the range)."""
    try:
        if "-" in text:
            low, high = text.split("-", 1)
            return int(low), int(high)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count like 3 or a range like 3-4, got {text!r}") from None


def _digits(text: str) -> int | tuple[int, int]:
    """"3" → 3 (both operands), "2,1" → (2, 1) (at most 2 digits for the first operand, 1 for the second)."""
    try:
        if "," in text:
            first, second = text.split(",", 1)
            return int(first), int(second)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a digit count like 3 or a pair like 2,1, got {text!r}") from None


_TEMPLATE_HELP = ("base: plain-text conversation; qwen-instruct: <|im_start|> chat markers (both TinyZero's, "
                  "<answer> tags); short: the question alone (tiny models on CPU); chat: the plain question in the "
                  "tokenizer's chat template, scored in the natural style (instruct models); tool: chat plus how to call "
                  "the calculator (multi-turn rollouts, actor_rollout_ref.rollout.multi_turn)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mppo data", description="Generate TinyZero-style task data locally.")
    tasks = parser.add_subparsers(dest="task", required=True, metavar="{countdown,multiply,gsm8k,tokenizer}")

    def common(sub: argparse.ArgumentParser, train_size: int, test_size: int) -> None:
        sub.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
        sub.add_argument("--train-size", type=int, default=train_size)
        sub.add_argument("--test-size", type=int, default=test_size)
        sub.add_argument("--seed", type=int, default=0)
        sub.add_argument("--template", choices=TEMPLATES, default="base", help=_TEMPLATE_HELP)

    countdown = tasks.add_parser("countdown", help="reach a target with + - * / using each number once")
    common(countdown, train_size=10_000, test_size=1_000)
    countdown.add_argument("--num-operands", type=_operand_range, default=3, help="a count (3) or a range (3-4)")
    countdown.add_argument("--min-number", type=int, default=1)
    countdown.add_argument("--max-number", type=int, default=100)
    countdown.add_argument("--max-target", type=int, default=1000)

    multiply = tasks.add_parser("multiply", help="multiply two integers")
    common(multiply, train_size=10_000, test_size=1_000)
    multiply.add_argument("--digits", type=_digits, default=3,
                          help="operands have at most this many digits (3), or A and B digits (2,1)")

    gsm8k = tasks.add_parser("gsm8k", help="GSM8K from local parquet files (question, answer ending '#### N')")
    gsm8k.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    gsm8k.add_argument("--train-file", required=True, help="a GSM8K-format parquet file (openai/gsm8k's columns)")
    gsm8k.add_argument("--test-file", help="the test split's file; without it --test-size rows of the train file "
                                           "are held out")
    gsm8k.add_argument("--train-size", type=int, help="keep the first N train rows (default: all)")
    gsm8k.add_argument("--test-size", type=int, help="test rows (default: all of --test-file, else 10%%)")
    gsm8k.add_argument("--seed", type=int, default=0, help="which train rows are held out without --test-file")
    gsm8k.add_argument("--template", choices=GSM8K_TEMPLATES, default="base",
                       help="base: veRL's instruction to answer after '####' (strict scoring); chat: the plain "
                            "question, natural scoring")

    tokenizer = tasks.add_parser("tokenizer", help="train a byte-level BPE tokenizer on a task's parquet files")
    tokenizer.add_argument("--data", required=True, help="directory with train.parquet (from `mppo data TASK`)")
    tokenizer.add_argument("--out", required=True, help="directory for the HF tokenizer files")
    tokenizer.add_argument("--vocab-size", type=int, default=512, help="including 256 byte tokens and specials")
    return parser


def _task_texts(data_dir: str) -> list[str]:
    """Prompt texts and their reference solutions: what the tokenizer will see in SFT and RL."""
    import os

    import pyarrow.parquet as pq

    path = os.path.join(data_dir, "train.parquet")
    if not os.path.isfile(path):
        raise TaskGenerationError(f"no {path}; generate the task first, e.g. `mppo data countdown --out {data_dir}`")
    texts = []
    for row in pq.read_table(path, columns=["prompt", "extra_info"]).to_pylist():
        texts.extend(message["content"] for message in row["prompt"])
        solution = (row.get("extra_info") or {}).get("solution")
        if solution is not None:  # in the answer format the rewards read, so its tags get tokens of their own
            texts.append(f"<think> </think> <answer> {solution} </answer>")
    return texts


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `mppo data ...`; `argv` are the arguments after `data`. Returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.task == "tokenizer":
        from mppo.data.tokenizer import build_local_tokenizer

        try:
            tokenizer = build_local_tokenizer(_task_texts(args.data), args.vocab_size, args.out)
        except TaskGenerationError as err:
            print(f"mppo data tokenizer: {err}", file=sys.stderr)
            return 2
        print(f"wrote a {len(tokenizer)}-token tokenizer to {args.out}")
        return 0
    if args.task == "gsm8k":
        try:
            train, test = write_gsm8k(args.train_file, args.out, test_file=args.test_file,
                                      train_size=args.train_size, test_size=args.test_size, template=args.template,
                                      seed=args.seed)
        except TaskGenerationError as err:
            print(f"mppo data gsm8k: {err}", file=sys.stderr)
            return 2
        print(f"wrote {train} and {test}")
        return 0
    if args.task == "countdown":
        options = {"num_operands": args.num_operands, "min_number": args.min_number,
                   "max_number": args.max_number, "max_target": args.max_target}
    else:
        options = {"digits": args.digits}
    try:
        train, test = write_task(args.task, args.out, train_size=args.train_size, test_size=args.test_size,
                                 seed=args.seed, template=args.template, **options)
    except TaskGenerationError as err:
        print(f"mppo data {args.task}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.train_size} train rows to {train} and {args.test_size} test rows to {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
