"""Context parallelism's index math against naive references written out here: megatron's load-balanced split
(rank r holds chunks r and 2*CP-1-r of 2*CP), its inverse, the CP-local view of a micro-batch's response
positions, the micro-batch length multiple and the layout checks. The multi-rank results (log-probs, updates and
values at CP2, CP2xTP2, CP2xPP2 against HF and CP1) are in tests/test_workers_parallel.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mppo.parallel import ParallelLayoutError, check_layout
from mppo.parallel.context_parallel import cp_positions, natural_order, split_for_cp
from mppo.workers.pipeline import cp_local_view, sequence_multiple


def naive_positions(seq_len: int, cp: int, rank: int) -> list[int]:
    chunks = [list(range(seq_len))[i * seq_len // (2 * cp):(i + 1) * seq_len // (2 * cp)] for i in range(2 * cp)]
    return chunks[rank] + chunks[2 * cp - 1 - rank]


@pytest.mark.parametrize("cp,seq_len", [(1, 6), (2, 8), (2, 16), (3, 12), (4, 32)])
def test_split_is_megatrons_load_balanced_split_and_merges_back(cp, seq_len):
    x = torch.randn(3, seq_len, 5)
    parts = []
    for rank in range(cp):
        assert cp_positions(seq_len, cp, rank).tolist() == naive_positions(seq_len, cp, rank)
        part = split_for_cp(x, 1, cp, rank)
        assert torch.equal(part, x[:, naive_positions(seq_len, cp, rank)])
        parts.append(part)
    merged = torch.cat(parts, dim=1).index_select(1, natural_order(seq_len, cp))
    assert torch.equal(merged, x)
    # every rank holds the same causal-attention work: sum over its positions of (position + 1)
    work = {sum(p + 1 for p in naive_positions(seq_len, cp, r)) for r in range(cp)}
    assert len(work) == 1


def test_split_needs_a_length_divisible_by_two_cp():
    with pytest.raises(ValueError, match="divisible by 2\\*cp = 4"):
        cp_positions(10, 2, 0)


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_local_view_reads_each_response_position_on_exactly_one_rank(cp):
    g = torch.Generator().manual_seed(0)
    b, t, seq_len = 4, 5, 12 * cp
    index = torch.randint(0, seq_len, (b, t), generator=g)
    valid = torch.rand(b, t, generator=g) > 0.2
    data = {"input_ids": torch.zeros(b, seq_len, dtype=torch.long), "response_index": index,
            "response_valid": valid, "response_mask": valid.float()}
    output = torch.randn(seq_len, b, generator=g)  # [s, b] like the model's hidden states
    rows = torch.arange(b)[:, None].expand(b, t)
    want = torch.where(valid, output[index, rows], 0.0)
    total, owners = torch.zeros(b, t), torch.zeros(b, t, dtype=torch.long)
    for rank in range(cp):
        view = cp_local_view(data, cp, rank)
        assert view["response_mask"] is data["response_mask"]  # the loss weights stay the whole sequence's
        local = output[cp_positions(seq_len, cp, rank)]  # what this rank's model returns
        total += torch.where(view["response_valid"], local[view["response_index"], rows], 0.0)
        owners += view["response_valid"].long()
    assert torch.equal(total, want)
    assert torch.equal(owners, valid.long())


def test_micro_batch_length_multiple():
    def config(tp, cp, sp):
        return SimpleNamespace(tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)

    assert sequence_multiple(config(1, 1, False)) == 1
    assert sequence_multiple(config(2, 1, True)) == 2
    assert sequence_multiple(config(1, 2, False)) == 4
    assert sequence_multiple(config(2, 2, True)) == 8
    assert sequence_multiple(config(2, 4, False)) == 8


def test_layout_check_counts_cp():
    assert check_layout(8, 2, 1, cp=2) == 2
    assert check_layout(8, 1, 2, cp=4) == 1
    with pytest.raises(ParallelLayoutError, match="not divisible by tp\\*pp\\*cp = 2\\*1\\*3 = 6"):
        check_layout(8, 2, 1, cp=3)
    with pytest.raises(ParallelLayoutError, match="ep=2.*cp=2.*not supported"):
        check_layout(8, 1, 1, ep=2, cp=2)
