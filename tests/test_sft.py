"""`mppo sft`: the loss falls, only response tokens carry loss (against a hand-computed loss), the saved directory
reloads with transformers to the same logits, the target text earns the task's full reward, and bad inputs give
clear errors."""
from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from mppo import sft
from mppo.cli import main as cli_main
from mppo.data import DatasetError, RLDataset, build_local_tokenizer, load_tokenizer, write_task
from mppo.data.tasks import countdown_prompt, generate_countdown
from mppo.rewards import default_compute_score

TINY = sft.TinyModelSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                         max_position_embeddings=256)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    texts = [countdown_prompt(p.target, p.numbers) + f" </think> <answer> {p.solution} </answer>"
             for p in generate_countdown(100, num_operands=2, max_number=20, seed=1)]
    build_local_tokenizer(texts, vocab_size=400, out_dir=out)
    return out


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    write_task("countdown", out, train_size=12, test_size=2, seed=0, num_operands=2, max_number=20, max_target=50)
    return out


def _examples(tok_dir, path, rows=None):
    tokenizer = load_tokenizer(tok_dir)
    return tokenizer, sft.build_examples(RLDataset(path, tokenizer), tokenizer, 32, rows)


@pytest.mark.parametrize("task,options", [("countdown", {"num_operands": 3, "max_number": 9, "max_target": 40}),
                                          ("multiply", {"digits": 2})])  # prompts ending "<think>" / "Assistant:"
def test_targets_earn_the_full_reward(task, options, tok_dir, tmp_path):
    """Decoded prompt + target response is scored by the task's own reward: every target must be correct."""
    write_task(task, tmp_path, train_size=6, test_size=1, seed=0, **options)
    tokenizer = load_tokenizer(tok_dir)
    dataset = RLDataset(tmp_path / "train.parquet", tokenizer)
    examples = sft.build_examples(dataset, tokenizer, 64)
    assert len(examples) == 6
    for item, example in zip((dataset[i] for i in range(6)), examples):
        assert example.input_ids[:example.prompt_length] == item.input_ids  # the prompt exactly as RL sees it
        assert example.input_ids[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(example.input_ids[:-1], skip_special_tokens=False)
        assert text.startswith(item.raw_prompt)
        assert default_compute_score(item.data_source, text, item.ground_truth) == 1.0, text


def test_loss_is_over_response_tokens_only(tok_dir, data_dir):
    """A 2-row padded batch against a loss computed by hand from each row's own unpadded forward."""
    tokenizer, examples = _examples(tok_dir, data_dir / "train.parquet")
    pair = [examples[0], max(examples, key=lambda e: len(e.input_ids))]
    assert len(pair[0].input_ids) != len(pair[1].input_ids) or pair[0].prompt_length != pair[1].prompt_length
    model = sft.init_tiny_model(tokenizer, TINY, seed=3)
    with torch.no_grad():
        got = sft.response_loss(model, sft.collate(pair, tokenizer.pad_token_id)).item()
        nll = []
        for example in pair:
            ids = torch.tensor([example.input_ids])
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            nll += [-log_probs[t - 1, example.input_ids[t]].item()
                    for t in range(example.prompt_length, len(example.input_ids))]
    assert math.isclose(got, sum(nll) / len(nll), rel_tol=1e-5)
    # the prompt tokens are far from predictable for a random model: counting them would change the loss
    with torch.no_grad():
        whole = torch.tensor([pair[0].input_ids])
        all_tokens = torch.nn.functional.cross_entropy(model(input_ids=whole).logits[0, :-1], whole[0, 1:]).item()
    assert not math.isclose(got, all_tokens, rel_tol=1e-3)


def test_training_lowers_the_loss_and_the_saved_model_reloads(tok_dir, data_dir, tmp_path):
    out = tmp_path / "model"
    config = sft.SFTConfig(steps=30, lr=3e-3, warmup_steps=3, batch_size=4, seed=0)
    result = sft.run_sft(data_dir / "train.parquet", out, tokenizer_path=str(tok_dir), tiny=TINY, config=config,
                         progress=False)
    losses = result.losses
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    assert not (tmp_path / ".model.tmp").exists()

    reloaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert reloaded.config.model_type == "qwen2" and reloaded.config.vocab_size == len(load_tokenizer(tok_dir))
    ids = torch.tensor([load_tokenizer(out)("Using the numbers [3, 4], create", add_special_tokens=False)["input_ids"]])
    assert ids.tolist() == [load_tokenizer(tok_dir)("Using the numbers [3, 4], create",
                                                    add_special_tokens=False)["input_ids"]]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, result.model(input_ids=ids).logits)

    # same seed, same data => the same losses, bit for bit; another seed differs
    again = sft.run_sft(data_dir / "train.parquet", tmp_path / "again", tokenizer_path=str(tok_dir), tiny=TINY,
                        config=config, progress=False)
    assert again.losses == losses
    other = sft.run_sft(data_dir / "train.parquet", tmp_path / "other", tokenizer_path=str(tok_dir), tiny=TINY,
                        config=sft.SFTConfig(steps=2, batch_size=4, seed=1), progress=False)
    assert other.losses[0] != losses[0]


def test_cli_fine_tunes_an_existing_model(tok_dir, data_dir, tmp_path, capsys):
    first = tmp_path / "first"
    args = ["--data", str(data_dir / "train.parquet"), "--steps", "2", "--batch-size", "2", "--no-progress"]
    assert cli_main(["sft", *args, "--out", str(first), "--init-tiny", "--tokenizer", str(tok_dir),
                     "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1"]) == 0
    assert sft.main([*args, "--out", str(tmp_path / "second"), "--model", str(first)]) == 0
    assert "saved" in capsys.readouterr().out
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "second").config.num_hidden_layers == 1


def _write_rows(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("case", ["no_data", "no_solution", "no_prompt", "no_tokenizer", "tiny_without_tokenizer",
                                  "no_model", "out_exists", "too_long"])
def test_bad_inputs_give_clear_errors(case, tok_dir, data_dir, tmp_path, capsys):
    row = {"data_source": "countdown", "prompt": [{"role": "user", "content": "Using [1, 2] Assistant:"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": 3, "numbers": [1, 2]}},
           "extra_info": {"index": 0, "solution": "1 + 2"}}
    data = str(data_dir / "train.parquet")
    source = ["--init-tiny", "--tokenizer", str(tok_dir)]
    extra: list[str] = []
    expected = {
        "no_data": "does not exist",
        "no_solution": "no extra_info.solution",
        "no_prompt": "has no 'prompt'",
        "no_tokenizer": "no tokenizer in",
        "tiny_without_tokenizer": "--init-tiny needs --tokenizer",
        "no_model": "no HF model in",
        "out_exists": "already exists",
        "too_long": "raise --max-response-length",
    }[case]
    if case == "no_data":
        data = str(tmp_path / "missing.parquet")
    elif case == "no_solution":
        data = str(_write_rows(tmp_path / "d.parquet", [{**row, "extra_info": {"index": 0}}]))
    elif case == "no_prompt":
        data = str(_write_rows(tmp_path / "d.parquet", [{k: v for k, v in row.items() if k != "prompt"}]))
    elif case == "no_tokenizer":
        source = ["--init-tiny", "--tokenizer", str(tmp_path)]
    elif case == "tiny_without_tokenizer":
        source = ["--init-tiny"]
    elif case == "no_model":
        source = ["--model", str(tmp_path), "--tokenizer", str(tok_dir)]
    elif case == "out_exists":
        (tmp_path / "out").mkdir()
    elif case == "too_long":
        extra = ["--max-response-length", "5"]
    status = sft.main(["--data", data, "--out", str(tmp_path / "out"), *source, *extra, "--steps", "1",
                       "--no-progress"])
    assert status == 2
    assert expected in capsys.readouterr().err


def test_api_errors_are_specific(tok_dir, data_dir, tmp_path):
    with pytest.raises(sft.SFTError, match="exactly one of"):
        sft.run_sft(data_dir / "train.parquet", tmp_path / "o", model_path=str(tmp_path), tiny=TINY)
    with pytest.raises(sft.SFTError, match="steps must be positive"):
        sft.run_sft(data_dir / "train.parquet", tmp_path / "o", tokenizer_path=str(tok_dir), tiny=TINY,
                    config=sft.SFTConfig(steps=0))
    with pytest.raises(DatasetError):
        sft.run_sft(_write_rows(tmp_path / "e.parquet", [{"x": 1}]), tmp_path / "o", tokenizer_path=str(tok_dir),
                    tiny=TINY)


def test_solution_noise_rewrites_operators_only():
    """Numbers, their order and the parentheses stay; each operator becomes one of + - * / (all of them occur)."""
    import random

    rng = random.Random(0)
    seen = set()
    for _ in range(50):
        noisy = sft.noisy_solution("(12 - 3) * 4", rng)
        parts = noisy.split(" ")
        assert [parts[0], parts[2], parts[4]] == ["(12", "3)", "4"], noisy
        assert parts[1] in "+-*/" and parts[3] in "+-*/" and len(parts) == 5
        seen.update((parts[1], parts[3]))
    assert seen == set("+-*/")


def test_solution_noise_demonstrations_use_the_numbers_and_are_right_part_of_the_time(tok_dir, tmp_path):
    """With noise 0.6 about 0.6 * 3/4 of the targets are wrong (a random operator may be the right one), every
    target still uses exactly the prompt's numbers in the answer format (the reward gives it at least the format
    score), noise 0 keeps every target correct, and the same seed gives the same targets."""
    write_task("countdown", tmp_path, train_size=400, test_size=1, seed=3, num_operands=2, max_number=20,
               max_target=400)
    tokenizer = load_tokenizer(tok_dir)
    dataset = RLDataset(tmp_path / "train.parquet", tokenizer)

    def scores(noise: float, seed: int) -> list[float]:
        examples = sft.build_examples(dataset, tokenizer, 32, solution_noise=noise, seed=seed)
        out = []
        for i, example in enumerate(examples):
            text = tokenizer.decode(example.input_ids[:-1], skip_special_tokens=False)
            out.append(default_compute_score("countdown", text, dataset[i].ground_truth))
        return out

    noisy = scores(0.6, seed=0)
    assert set(noisy) <= {0.1, 1.0}  # 0.1: well-formed, each number used once, wrong value
    wrong = noisy.count(0.1) / len(noisy)
    assert 0.33 < wrong < 0.57, wrong  # expected ~0.45 minus the draws that hit another correct operator
    assert scores(0.6, seed=0) == noisy and scores(0.6, seed=1) != noisy
    assert set(scores(0.0, seed=0)) == {1.0}


def test_solution_noise_errors(tok_dir, tmp_path):
    write_task("multiply", tmp_path, train_size=4, test_size=1, seed=0, digits=1)
    tokenizer = load_tokenizer(tok_dir)
    with pytest.raises(sft.SFTError, match="has none"):
        sft.build_examples(RLDataset(tmp_path / "train.parquet", tokenizer), tokenizer, 32, solution_noise=1.0)
    with pytest.raises(sft.SFTError, match=r"fraction in \[0, 1\]"):
        sft.SFTConfig(solution_noise=1.5).check()
