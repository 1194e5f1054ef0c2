"""The workers' data contract and micro-batching (mppo.workers.batching), against loops written independently."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from workers_fixtures import B, P, PROMPT_LENGTHS, RESPONSE_LENGTHS, T, make_batch  # noqa: E402

from mppo.workers.batching import (ROUTES_KEY, BatchError, make_micro_batch, make_micro_batches,  # noqa: E402
                                   mini_batch_rows, pad_to_uniform, scatter_rows, split_by_tokens, split_to_multiple,
                                   validate_batch)


@pytest.fixture
def batch():
    return make_batch(vocab=50, seed=1)


def test_validate_accepts_the_contract_and_returns_shape(batch):
    assert validate_batch(batch, ["advantages"]) == (B, T)


@pytest.mark.parametrize("breakage, message", [
    (lambda b: b.pop("responses"), "missing"),
    (lambda b: b.__setitem__("responses", b["responses"].flip(1)), "responses differ"),
    (lambda b: b.__setitem__("position_ids", b["position_ids"] + 1), "position_ids"),
    (lambda b: b.__setitem__("advantages", b["advantages"][:, :-1]), "advantages must be [B, T]"),
    (lambda b: b["attention_mask"].__setitem__((0, slice(0, P)), 0), "no attended prompt token"),
    (lambda b: b["response_mask"].__setitem__((1, T - 1), 1.0), "attention_mask leaves out"),
])
def test_validate_rejects_broken_batches(batch, breakage, message):
    breakage(batch)
    with pytest.raises(BatchError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_batch(batch, ["advantages"])


def test_validate_names_a_missing_update_input(batch):
    with pytest.raises(BatchError, match="ref_log_prob"):
        validate_batch(batch, ["ref_log_prob"])


def test_compaction_moves_tokens_to_the_front_and_indexes_the_predicting_position(batch):
    rows = torch.tensor([3, 0, 6])
    mb = make_micro_batch(batch, rows)
    ids = mb.data["input_ids"]
    assert ids.shape == (3, max(PROMPT_LENGTHS[r] + RESPONSE_LENGTHS[r] for r in rows.tolist()))
    for i, r in enumerate(rows.tolist()):
        tokens = [t for t, m in zip(batch["input_ids"][r].tolist(), batch["attention_mask"][r].tolist()) if m]
        assert ids[i, :len(tokens)].tolist() == tokens and ids[i, len(tokens):].eq(0).all()
        for j in range(T):
            valid = j < RESPONSE_LENGTHS[r]
            assert bool(mb.data["response_valid"][i, j]) == valid
            if valid:  # column c-1 predicts response token j, which sits at column c = prompt length + j
                c = PROMPT_LENGTHS[r] + j
                assert int(mb.data["response_index"][i, j]) == c - 1
                assert ids[i, c] == batch["responses"][r, j]
    assert torch.equal(mb.data["advantages"], batch["advantages"][rows])


def test_token_budget_groups_fit_and_cover_every_row_once(batch):
    lengths = batch["attention_mask"].sum(1)
    groups = split_by_tokens(torch.arange(B), lengths, max_token_len=20)
    assert sorted(torch.cat(groups).tolist()) == list(range(B))
    for g in groups:
        assert len(g) * int(lengths[g].max()) <= 20
    assert len(groups) < B  # short rows share micro-batches
    with pytest.raises(ValueError, match="raise ppo_max_token_len_per_gpu to at least 13"):
        split_by_tokens(torch.arange(B), lengths, max_token_len=12)


def test_split_to_multiple_and_count_errors(batch):
    groups = split_to_multiple([torch.tensor([0, 1, 2]), torch.tensor([3])], 4)
    assert len(groups) == 4 and sorted(torch.cat(groups).tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiple of 2"):
        split_to_multiple([torch.tensor([0])], 2)
    with pytest.raises(ValueError, match="multiple of 2"):
        make_micro_batches(batch, torch.arange(3), micro_batch_size=1, multiple_of=2)
    with pytest.raises(ValueError, match="exactly one"):
        make_micro_batches(batch, torch.arange(3))


def test_pad_to_uniform_pads_rows_and_input_length_only(batch):
    mbs = make_micro_batches(batch, torch.arange(B), micro_batch_size=3)
    padded = pad_to_uniform(mbs)
    shapes = {tuple(p["input_ids"].shape) for p in padded}
    assert len(shapes) == 1
    last = padded[-1]  # 2 real rows + 1 padded row
    assert last["response_mask"].shape == (3, T) and last["response_mask"][2].eq(0).all()
    assert not last["response_valid"][2].any()


def test_routes_move_with_their_tokens_into_micro_batches(batch):
    """routed_experts [B, P+T, layers, k] by input_ids column: compacted like the tokens, padding -> experts 0..k-1,
    and padded to the uniform shape the same way."""
    layers, k = 3, 2
    cols = P + T
    # an entry names its row, column, layer and slot, so any misplacement shows
    routes = (torch.arange(B)[:, None, None, None] * 1000 + torch.arange(cols)[None, :, None, None] * 10
              + torch.arange(layers)[None, None, :, None] * 2 + torch.arange(k)).int()
    batch[ROUTES_KEY] = routes
    validate_batch(batch)
    mbs = make_micro_batches(batch, torch.arange(B), micro_batch_size=3)
    for mb in mbs:
        got = mb.data[ROUTES_KEY]
        assert got.shape == (*mb.data["input_ids"].shape, layers, k)
        for i, row in enumerate(mb.rows.tolist()):
            attended = batch["attention_mask"][row].bool().nonzero().flatten()
            assert torch.equal(got[i, :len(attended)], routes[row, attended])
            assert (got[i, len(attended):] == torch.arange(k, dtype=torch.int32)).all()
    padded = pad_to_uniform(mbs)
    last, mb = padded[-1], mbs[-1]
    assert last[ROUTES_KEY].shape == (*last["input_ids"].shape, layers, k)
    b, s = mb.data["input_ids"].shape
    assert torch.equal(last[ROUTES_KEY][:b, :s], mb.data[ROUTES_KEY])
    assert (last[ROUTES_KEY][b:] == torch.arange(k, dtype=torch.int32)).all()
    batch[ROUTES_KEY] = routes[:, 1:]
    with pytest.raises(BatchError, match="routed_experts must be"):
        validate_batch(batch)


def test_mini_batches_and_scatter():
    assert [r.tolist() for r in mini_batch_rows(6, 3)] == [[0, 1, 2], [3, 4, 5]]
    shuffled = mini_batch_rows(6, 3, shuffle=True, generator=torch.Generator().manual_seed(0))
    assert sorted(torch.cat(shuffled).tolist()) == list(range(6))
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        mini_batch_rows(5, 2)
    parts = [(torch.tensor([2, 0]), torch.tensor([[1.0], [2.0]])), (torch.tensor([1]), torch.tensor([[3.0]]))]
    out = scatter_rows(parts, 3)
    assert out.flatten().tolist() == [2.0, 3.0, 1.0]
