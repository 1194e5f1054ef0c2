"""RLDataset (parquet → tokenized prompts, with clear errors for bad data) and the resumable PromptLoader."""
from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mppo.data.dataset import DatasetError, PromptItem, RLDataset
from mppo.data.loader import PromptLoader, collate
from mppo.data.tasks import generate_countdown, countdown_prompt, write_task
from mppo.data.tokenizer import build_local_tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    texts = [countdown_prompt(p.target, p.numbers) for p in generate_countdown(200, seed=5)]
    return build_local_tokenizer(texts, vocab_size=400, out_dir=tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("countdown")
    write_task("countdown", out, train_size=30, test_size=6, seed=11, num_operands=(3, 4))
    return out


def _row(i: int) -> dict:
    return {"data_source": "countdown", "prompt": [{"role": "user", "content": f"User: add {i} and 1\nAssistant:"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": {"target": i + 1, "numbers": [i, 1]}},
            "extra_info": {"split": "train", "index": i}}


def _write(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_items_hold_tokens_text_and_reward_info(tok, data_dir):
    dataset = RLDataset(str(data_dir / "train.parquet"), tok, max_prompt_length=512, apply_chat_template=False)
    rows = pq.read_table(data_dir / "train.parquet").to_pylist()
    assert len(dataset) == 30
    for i in (0, 17, 29):
        item = dataset[i]
        content = rows[i]["prompt"][0]["content"]
        assert item.raw_prompt == content
        assert item.input_ids == tok(content, add_special_tokens=False)["input_ids"]
        assert item.data_source == "countdown" and item.index == i
        assert item.ground_truth == rows[i]["reward_model"]["ground_truth"]
        assert item.extra_info == rows[i]["extra_info"]
    both = RLDataset([data_dir / "train.parquet", data_dir / "test.parquet"], tok, max_prompt_length=512,
                     apply_chat_template=False)
    assert len(both) == 36 and both[30].extra_info["split"] == "test" and both[30].index == 30
    with pytest.raises(IndexError):
        dataset[30]


def test_chat_template_modes(tok, data_dir, tmp_path):
    path = str(data_dir / "test.parquet")
    content = pq.read_table(path).to_pylist()[0]["prompt"][0]["content"]
    templated = RLDataset(path, tok, max_prompt_length=512, apply_chat_template=True)[0].raw_prompt
    assert templated == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    # TinyZero rows already open the assistant's turn: "auto" uses them as written, as False does.
    assert RLDataset(path, tok, max_prompt_length=512, apply_chat_template="auto")[0].raw_prompt == content
    assert RLDataset(path, tok, max_prompt_length=512, apply_chat_template=False)[0].raw_prompt == content
    question = _row(0)
    question["prompt"] = [{"role": "user", "content": "What is 2 + 3?"}]
    question_path = _write(tmp_path / "question.parquet", [question])
    assert (RLDataset(question_path, tok, apply_chat_template="auto")[0].raw_prompt
            == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    plain = load_tokenizer(tok.name_or_path)
    plain.chat_template = None
    assert RLDataset(question_path, plain, apply_chat_template="auto")[0].raw_prompt == "What is 2 + 3?"
    with pytest.raises(DatasetError, match="no chat template"):
        RLDataset(path, plain, max_prompt_length=512, apply_chat_template=True)
    two = _row(0)
    two["prompt"] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    two_path = _write(tmp_path / "two.parquet", [two])
    with pytest.raises(DatasetError, match=r"row 0 of .*two\.parquet.* has 2 messages.*apply_chat_template"):
        RLDataset(two_path, tok, max_prompt_length=512, apply_chat_template=False)
    rendered = RLDataset(two_path, tok, max_prompt_length=512, apply_chat_template="auto")[0].raw_prompt
    assert rendered.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi")


def test_missing_unreadable_and_empty_files(tok, tmp_path):
    missing = tmp_path / "nope" / "train.parquet"
    with pytest.raises(FileNotFoundError, match=r"nope/train\.parquet.*mppo data countdown --out"):
        RLDataset(str(missing), tok)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all")
    with pytest.raises(DatasetError, match=r"garbage\.parquet.*mppo data countdown"):
        RLDataset(str(garbage), tok)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([_row(0)]).slice(0, 0), empty)
    with pytest.raises(DatasetError, match="no rows"):
        RLDataset(str(empty), tok)
    with pytest.raises(DatasetError, match="no data files"):
        RLDataset([], tok)


@pytest.mark.parametrize("field, breaks, message", [
    ("prompt", None, r"row 2 of .*bad\.parquet.* has no 'prompt'"),
    ("prompt", [], r"row 2 of .*bad\.parquet.* has no 'prompt'"),
    ("reward_model", {"style": "rule", "ground_truth": None}, r"row 2 of .*bad\.parquet.* reward_model\.ground_truth"),
    ("reward_model", None, r"row 2 of .*bad\.parquet.* reward_model\.ground_truth"),
    ("data_source", None, r"row 2 of .*bad\.parquet.* has no data_source"),
])
def test_rows_missing_fields_are_reported_by_index(tok, tmp_path, field, breaks, message):
    rows = [_row(i) for i in range(4)]
    rows[2][field] = breaks
    with pytest.raises(DatasetError, match=message):
        RLDataset(_write(tmp_path / "bad.parquet", rows), tok)


def test_overlong_prompts_filtered_or_refused(tok, tmp_path, caplog):
    rows = [_row(i) for i in range(6)]
    rows[1]["prompt"][0]["content"] = "User: " + "spam " * 100 + "\nAssistant:"
    rows[4]["prompt"][0]["content"] = "User: " + "eggs " * 100 + "\nAssistant:"
    path = _write(tmp_path / "long.parquet", rows)
    limit = 40
    lengths = [len(tok(r["prompt"][0]["content"], add_special_tokens=False)["input_ids"]) for r in rows]
    assert [n > limit for n in lengths] == [False, True, False, False, True, False]

    with caplog.at_level(logging.WARNING, logger="mppo.data.dataset"):
        kept = RLDataset(path, tok, max_prompt_length=limit, filter_overlong_prompts=True)
    assert [kept[i].extra_info["index"] for i in range(len(kept))] == [0, 2, 3, 5]
    assert [kept[i].index for i in range(len(kept))] == [0, 1, 2, 3]
    assert "dropped 2 of 6 prompts" in caplog.text and kept.num_dropped_overlong == 2

    for refuse in (False, "error"):
        with pytest.raises(DatasetError, match=rf"2 of 6 .*max_prompt_length=40.*row 1 of .*long\.parquet' "
                                               rf"\({lengths[1]} tokens\).*filter_overlong_prompts=true"):
            RLDataset(path, tok, max_prompt_length=limit, filter_overlong_prompts=refuse)
    assert len(RLDataset(path, tok, max_prompt_length=max(lengths), filter_overlong_prompts=False)) == 6

    with pytest.raises(DatasetError, match="all 6 prompts are longer"):
        RLDataset(path, tok, max_prompt_length=3)
    with pytest.raises(ValueError, match="filter_overlong_prompts"):
        RLDataset(path, tok, filter_overlong_prompts="sometimes")


def _items(n: int) -> list[PromptItem]:
    return [PromptItem(input_ids=list(range(1, 2 + i % 5)), raw_prompt=f"p{i}", data_source="countdown",
                       ground_truth={"target": i}, extra_info={"i": i}, index=i) for i in range(n)]


def test_collate_left_pads():
    items = _items(3)[1:3]  # prompts of 2 and 3 tokens
    batch = collate(items, pad_token_id=9)
    assert batch.input_ids.tolist() == [[9, 1, 2], [1, 2, 3]]
    assert batch.attention_mask.tolist() == [[0, 1, 1], [1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 0, 1], [0, 1, 2]]
    assert batch.indices.tolist() == [1, 2] and batch.raw_prompts == ["p1", "p2"] and len(batch) == 2
    assert batch.ground_truths == [{"target": 1}, {"target": 2}] and batch.extra_infos == [{"i": 1}, {"i": 2}]
    fixed = collate(items, pad_token_id=9, pad_to_length=5)
    assert fixed.input_ids.tolist() == [[9, 9, 9, 1, 2], [9, 9, 1, 2, 3]]
    with pytest.raises(ValueError, match="shorter than the longest prompt"):
        collate(items, pad_token_id=9, pad_to_length=2)


def test_prompt_batch_slices_and_repeats_every_field():
    items = _items(4)
    batch = collate(items, pad_token_id=9)
    part = batch[1:3]  # the same as collating those prompts at the batch's width
    reference = collate(items[1:3], pad_token_id=9, pad_to_length=batch.input_ids.shape[1])
    for name in ("input_ids", "attention_mask", "position_ids", "indices"):
        assert torch.equal(getattr(part, name), getattr(reference, name)), name
    assert (part.raw_prompts, part.data_sources) == (reference.raw_prompts, reference.data_sources)
    assert (part.ground_truths, part.extra_infos) == (reference.ground_truths, reference.extra_infos)
    twice = batch.repeat(2)  # prompt-major: each prompt n times in a row, as engines return the n responses
    rows = collate([item for item in items for _ in range(2)], pad_token_id=9)
    for name in ("input_ids", "attention_mask", "position_ids", "indices"):
        assert torch.equal(getattr(twice, name), getattr(rows, name)), name
    assert twice.raw_prompts == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"] and len(twice) == 8
    assert twice.extra_infos == rows.extra_infos and twice.ground_truths == rows.ground_truths
    with pytest.raises(TypeError, match="sliced by a slice"):
        batch[0]


def _run(loader: PromptLoader, epochs: int) -> list[list[int]]:
    return [batch.indices.tolist() for _ in range(loader.epoch, epochs) for batch in loader]


def test_loader_epochs_are_seeded_permutations():
    loader = PromptLoader(_items(10), 4, pad_token_id=0, seed=3)
    assert len(loader) == 2  # drop_last
    batches = _run(loader, 3)
    assert len(batches) == 6 and all(len(b) == 4 for b in batches)
    for epoch in range(3):
        seen = batches[2 * epoch] + batches[2 * epoch + 1]
        assert len(set(seen)) == 8
    assert batches[0:2] != batches[2:4]
    assert _run(PromptLoader(_items(10), 4, pad_token_id=0, seed=3), 3) == batches
    assert _run(PromptLoader(_items(10), 4, pad_token_id=0, seed=4), 3) != batches
    ordered = _run(PromptLoader(_items(10), 4, pad_token_id=0, shuffle=False, drop_last=False), 1)
    assert ordered == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 5])
def test_loader_resume_matches_uninterrupted(stop_after):
    uninterrupted = _run(PromptLoader(_items(11), 3, pad_token_id=0, seed=21), 3)  # 3 batches per epoch

    first = PromptLoader(_items(11), 3, pad_token_id=0, seed=21)
    taken = []
    iterator = iter(first)
    while len(taken) < stop_after:
        try:
            taken.append(next(iterator).indices.tolist())
        except StopIteration:  # end of an epoch: the loader moved on to the next one
            iterator = iter(first)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would store it

    resumed = PromptLoader(_items(11), 3, pad_token_id=0, seed=21)
    resumed.load_state_dict(state)
    assert taken + _run(resumed, 3) == uninterrupted


def test_loader_refuses_mismatched_state_and_tiny_datasets():
    state = PromptLoader(_items(11), 3, pad_token_id=0, seed=21).state_dict()
    with pytest.raises(ValueError, match="dataset_size=11 but this run has dataset_size=12"):
        PromptLoader(_items(12), 3, pad_token_id=0, seed=21).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptLoader(_items(11), 3, pad_token_id=0, seed=22).load_state_dict(state)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptLoader(_items(2), 3, pad_token_id=0)


def test_dataset_through_loader(tok, data_dir):
    dataset = RLDataset(str(data_dir / "train.parquet"), tok, max_prompt_length=512, apply_chat_template=False)
    batch = next(iter(PromptLoader(dataset, 8, pad_token_id=tok.pad_token_id, seed=0)))
    assert batch.input_ids.shape[0] == 8 and batch.input_ids.dtype == torch.int64
    for row in range(8):
        ids = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        assert ids == dataset[int(batch.indices[row])].input_ids
        assert tok.decode(ids) == batch.raw_prompts[row]
    assert (batch.input_ids[batch.attention_mask == 0] == tok.pad_token_id).all()
