"""`mppo data countdown` then `mppo data tokenizer`: a tokenizer that round-trips the task's own texts."""
from __future__ import annotations

import pyarrow.parquet as pq

from mppo.data import load_tokenizer
from mppo.data.cli import main


def test_task_then_tokenizer_round_trip(tmp_path, capsys):
    data, tok = tmp_path / "data", tmp_path / "tok"
    assert main(["countdown", "--out", str(data), "--train-size", "40", "--test-size", "8", "--max-number", "20",
                 "--max-target", "50"]) == 0
    assert main(["tokenizer", "--data", str(data), "--out", str(tok), "--vocab-size", "300"]) == 0
    tokenizer = load_tokenizer(tok)
    assert len(tokenizer) == 300
    row = pq.read_table(data / "test.parquet").to_pylist()[0]
    text = row["prompt"][0]["content"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|endoftext|>"


def test_tokenizer_learns_the_answer_format_of_a_short_prompt_task(tmp_path):
    """The short template's prompts never show the answer tags; the tokenizer is trained on the solutions in the
    answer format too, so `<answer>` costs a few tokens, not one per letter."""
    data, tok = tmp_path / "data", tmp_path / "tok"
    assert main(["countdown", "--out", str(data), "--train-size", "200", "--test-size", "8", "--num-operands", "2",
                 "--max-number", "20", "--template", "short"]) == 0
    assert main(["tokenizer", "--data", str(data), "--out", str(tok), "--vocab-size", "400"]) == 0
    tokenizer = load_tokenizer(tok)
    answer = " </think> <answer> 12 + 7 </answer>"
    ids = tokenizer(answer)["input_ids"]
    assert tokenizer.decode(ids) == answer
    assert len(ids) <= 16, tokenizer.convert_ids_to_tokens(ids)  # 36 characters; byte-level would be 36 tokens


def test_tokenizer_without_task_data_names_the_fix(tmp_path, capsys):
    assert main(["tokenizer", "--data", str(tmp_path / "missing"), "--out", str(tmp_path / "tok")]) == 2
    assert "mppo data countdown --out" in capsys.readouterr().err
