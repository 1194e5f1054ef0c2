"""GSM8K from local parquet files (no download) into veRL's row format.

The input is GSM8K's own format (the `openai/gsm8k` dataset's parquet files): a `question` column and an `answer`
column whose worked solution ends with `#### <number>`. Rows are written as veRL's `examples/data_preprocess/
gsm8k.py` writes them:

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question (+ veRL's instruction under the "base" template)}]
    ability       "math"
    reward_model  {"style": "rule" (base) | "natural" (chat), "ground_truth": the number after ####, commas removed}
    extra_info    {"split", "index", "answer": the worked solution, "question": the question}

Templates: "base" appends veRL's instruction (`Let's think step by step and output the final answer after
"####".`) and is scored strictly (the number after `#### `); "chat" is the plain question, scored in the "natural"
style (mppo.rewards.answer).
"""
from __future__ import annotations

import os
import random
import re
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from mppo.data.tasks import TaskGenerationError, reward_style, write_parquet

DATA_SOURCE = "openai/gsm8k"
GSM8K_TEMPLATES = ("base", "chat")
VERL_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def final_answer(answer: str) -> str | None:
    """The number after `#### ` in a GSM8K solution, commas removed (veRL's extract_solution)."""
    match = _FINAL_ANSWER.search(answer)
    return None if match is None else match.group(1).replace(",", "")


def read_gsm8k(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    """(question, answer) rows of a GSM8K-format parquet file; every bad row is reported by number."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TaskGenerationError(f"GSM8K file {path!r} does not exist; give a parquet file with 'question' and "
                                  "'answer' columns (the openai/gsm8k format)")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise TaskGenerationError(f"cannot read {path!r} as parquet ({type(err).__name__}: {err})") from err
    missing = {"question", "answer"} - set(table.column_names)
    if missing:
        raise TaskGenerationError(f"{path!r} has no column(s) {sorted(missing)} (it has {table.column_names}); "
                                  "GSM8K files have 'question' and 'answer' (ending in '#### <number>')")
    rows = table.select(["question", "answer"]).to_pylist()
    for i, row in enumerate(rows):
        if not isinstance(row["question"], str) or not isinstance(row["answer"], str) or \
                final_answer(row["answer"]) is None:
            raise TaskGenerationError(f"row {i} of {path!r} is not a GSM8K problem: it needs a question and an "
                                      "answer that ends in '#### <number>'")
    return rows


def gsm8k_rows(problems: list[dict[str, str]], split: str, template: str = "base") -> list[dict[str, Any]]:
    if template not in GSM8K_TEMPLATES:
        raise TaskGenerationError(f"template {template!r} does not apply to gsm8k; choose one of {GSM8K_TEMPLATES}")
    out = []
    for i, problem in enumerate(problems):
        question = problem["question"]
        content = question if template == "chat" else f"{question} {VERL_INSTRUCTION}"
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": reward_style(template), "ground_truth": final_answer(problem["answer"])},
            "extra_info": {"split": split, "index": i, "answer": problem["answer"], "question": question},
        })
    return out


def write_gsm8k(train_file: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                test_file: str | os.PathLike[str] | None = None, train_size: int | None = None,
                test_size: int | None = None, template: str = "base", seed: int = 0) -> tuple[str, str]:
    """Write out_dir/train.parquet and out_dir/test.parquet from local GSM8K files.

    With `test_file`, each split comes from its own file (the first `train_size` / `test_size` rows when given).
    Without it, `test_size` rows (default 10%, at least 1) of `train_file`, chosen with `seed`, are held out.
    """
    train = read_gsm8k(train_file)
    if test_file is not None:
        test = read_gsm8k(test_file)
    else:
        held_out = test_size if test_size is not None else max(1, len(train) // 10)
        if not 1 <= held_out < len(train):
            raise TaskGenerationError(f"cannot hold out {held_out} of the {len(train)} rows of {train_file} as the "
                                      "test split; pass --test-file or a smaller --test-size")
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        test = [train[i] for i in sorted(order[:held_out])]
        train = [train[i] for i in sorted(order[held_out:])]
    for name, size, rows in (("train", train_size, train), ("test", test_size, test)):
        if size is not None and not 1 <= size <= len(rows):
            raise TaskGenerationError(f"--{name}-size {size} is outside 1..{len(rows)} (the {name} rows available)")
    train = train[:train_size] if train_size is not None else train
    test = test[:test_size] if test_size is not None else test
    paths = (os.path.join(out_dir, "train.parquet"), os.path.join(out_dir, "test.parquet"))
    write_parquet(gsm8k_rows(train, "train", template), paths[0])
    write_parquet(gsm8k_rows(test, "test", template), paths[1])
    return paths
