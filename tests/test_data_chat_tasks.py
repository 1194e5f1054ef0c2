"""Tasks for instruct models: `mppo data multiply|countdown|gsm8k --template chat` (the plain question, the
tokenizer's chat template applied at tokenization, scored in the natural style), `--digits A,B`, and GSM8K from a
local GSM8K-format parquet with no download."""
from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mppo.data.cli import main as data_main
from mppo.data.dataset import RLDataset
from mppo.data.tasks import TaskGenerationError, generate_multiply
from mppo.data.tokenizer import build_local_tokenizer
from mppo.rewards import RewardManager


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [f"What is {a} * {b}? Answer with a number. {a} * {b} = {a * b}." for a in range(20) for b in range(10)]
    return build_local_tokenizer(texts, vocab_size=400, out_dir=tmp_path_factory.mktemp("tok"))


def _score(tok, dataset: RLDataset, index: int, response: str) -> float:
    """What the trainer does with a rollout: decoded prompt ids + response ids through the reward manager."""
    item = dataset[index]
    ids = torch.tensor([tok(response + tok.eos_token, add_special_tokens=False)["input_ids"]])
    scores, _ = RewardManager(tok)([item.input_ids], ids, torch.ones_like(ids), [item.data_source],
                                   [item.ground_truth], [item.extra_info])
    return scores.sum().item()


def test_multiply_chat_rows_render_in_the_chat_template_and_score_the_natural_answer(tok, tmp_path):
    assert data_main(["multiply", "--out", str(tmp_path), "--digits", "2,1", "--template", "chat",
                      "--train-size", "40", "--test-size", "10", "--seed", "4"]) == 0
    row = pq.read_table(tmp_path / "train.parquet").to_pylist()[0]
    a, b = map(int, re.fullmatch(r"What is (\d+) \* (\d+)\? Answer with a number\.",
                                 row["prompt"][0]["content"]).groups())
    assert row["reward_model"] == {"style": "natural", "ground_truth": a * b}
    dataset = RLDataset(str(tmp_path / "train.parquet"), tok, max_prompt_length=128)  # apply_chat_template auto
    item = dataset[0]
    assert item.raw_prompt == (f"<|im_start|>user\nWhat is {a} * {b}? Answer with a number.<|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert item.extra_info["reward_style"] == "natural"
    assert _score(tok, dataset, 0, f"{a} * {b} = {a * b}.") == 1.0
    assert _score(tok, dataset, 0, f"It is {a * b + 1}.") == pytest.approx(0.05)
    assert _score(tok, dataset, 0, "I do not know.") == 0.0
    # The same problems under TinyZero's template are scored by the rule style: a plain answer gets nothing.
    assert data_main(["multiply", "--out", str(tmp_path / "rule"), "--digits", "2,1", "--train-size", "40",
                      "--test-size", "10", "--seed", "4"]) == 0
    rule = RLDataset(str(tmp_path / "rule" / "train.parquet"), tok, max_prompt_length=2048)
    assert "reward_style" not in rule[0].extra_info
    assert _score(tok, rule, 0, f"{a} * {b} = {a * b}.") == 0.0


def test_countdown_chat_rows(tok, tmp_path):
    assert data_main(["countdown", "--out", str(tmp_path), "--num-operands", "2", "--max-number", "9",
                      "--max-target", "81", "--template", "chat", "--train-size", "8", "--test-size", "2"]) == 0
    row = pq.read_table(tmp_path / "test.parquet").to_pylist()[0]
    assert re.fullmatch(r"Using the numbers \[\d, \d\], create an equation that equals \d+\. Use \+, -, \* or / "
                        r"and each number exactly once\.", row["prompt"][0]["content"])
    assert row["reward_model"]["style"] == "natural"
    dataset = RLDataset(str(tmp_path / "test.parquet"), tok, max_prompt_length=128)
    solution = row["extra_info"]["solution"]
    assert _score(tok, dataset, 0, f"We get {solution} = {row['reward_model']['ground_truth']['target']}.") == 1.0


def test_asymmetric_digits():
    problems = generate_multiply(900, digits=(2, 1), seed=0)
    assert len({(p.a, p.b) for p in problems}) == 900
    assert max(p.a for p in problems) == 99 and max(p.b for p in problems) == 9 and min(p.b for p in problems) == 0
    assert generate_multiply(50, digits=(3, 3), seed=7) == generate_multiply(50, digits=3, seed=7)
    with pytest.raises(TaskGenerationError, match="at most 1000 exist"):
        generate_multiply(1001, digits=(2, 1))
    with pytest.raises(SystemExit):
        data_main(["multiply", "--out", "x", "--digits", "2,one"])


# GSM8K's own format (the openai/gsm8k parquet files), written by hand.
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A shop sells 1,000 pens a day for 2 days. How many pens does it sell?",
     "answer": "It sells 1,000 * 2 = 2,000 pens.\n#### 2,000"},
    {"question": "Tom has 5 apples and eats 2. How many are left?", "answer": "5 - 2 = 3\n#### 3"},
    {"question": "What is half of 9?", "answer": "9 / 2 = 4.5\n#### 4.5"},
]


def test_gsm8k_from_a_local_parquet(tok, tmp_path):
    source = tmp_path / "gsm8k-train.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), source)
    test_source = tmp_path / "gsm8k-test.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS[:2]), test_source)
    out = tmp_path / "base"
    assert data_main(["gsm8k", "--train-file", str(source), "--test-file", str(test_source), "--out", str(out)]) == 0
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert len(rows) == 4 and pq.read_table(out / "test.parquet").num_rows == 2
    # veRL's examples/data_preprocess/gsm8k.py row, by hand
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": GSM8K_ROWS[1]["question"] + " Let's think step by step and output "
                                               "the final answer after \"####\"."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "2000"},
        "extra_info": {"split": "train", "index": 1, "answer": GSM8K_ROWS[1]["answer"],
                       "question": GSM8K_ROWS[1]["question"]},
    }
    base = RLDataset(str(out / "train.parquet"), tok, max_prompt_length=2048)
    assert _score(tok, base, 0, GSM8K_ROWS[0]["answer"]) == 1.0  # the worked solution, strict '####'
    assert _score(tok, base, 0, "They sold 72 clips.") == 0.0  # strict: no '####'

    chat = tmp_path / "chat"
    assert data_main(["gsm8k", "--train-file", str(source), "--test-size", "1", "--seed", "1", "--template", "chat",
                      "--out", str(chat)]) == 0
    train = pq.read_table(chat / "train.parquet").to_pylist()
    test = pq.read_table(chat / "test.parquet").to_pylist()
    assert len(train) == 3 and len(test) == 1
    assert {r["extra_info"]["question"] for r in train} | {test[0]["extra_info"]["question"]} == \
        {r["question"] for r in GSM8K_ROWS}  # held out from the train file, no overlap
    assert train[0]["prompt"][0]["content"] == train[0]["extra_info"]["question"]  # the plain question
    dataset = RLDataset(str(chat / "train.parquet"), tok, max_prompt_length=2048)
    for i, row in enumerate(train):
        final = row["reward_model"]["ground_truth"]
        assert _score(tok, dataset, i, f"So the answer is {final}.") == 1.0, row


def test_gsm8k_bad_files_are_named(tmp_path, capsys):
    assert data_main(["gsm8k", "--train-file", str(tmp_path / "missing.parquet"), "--out", str(tmp_path)]) == 2
    assert "missing.parquet" in capsys.readouterr().err
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "x", "solution": "1"}]), wrong)
    assert data_main(["gsm8k", "--train-file", str(wrong), "--out", str(tmp_path / "o")]) == 2
    assert "'answer', 'question'" in capsys.readouterr().err
    no_final = tmp_path / "no_final.parquet"
    pq.write_table(pa.Table.from_pylist([*GSM8K_ROWS, {"question": "q", "answer": "no final line"}]), no_final)
    assert data_main(["gsm8k", "--train-file", str(no_final), "--out", str(tmp_path / "o")]) == 2
    assert "row 4" in capsys.readouterr().err
