"""Qwen3 dense and Qwen3-MoE (4 experts, top-2) as megatron models vs HF transformers at TP1, TP2, PP2, EP2,
TP2 x EP2, EP2 x PP2, EP4 and TP2 x EP2 with expert-TP 1 (whole experts split over the TP ranks; 4 CPU ranks):
logits, log-probs, entropy, gradients through the router and the all-to-all dispatch; HF -> megatron -> HF bitwise
with the experts on several EP ranks; `mppo convert --ep`; an EP2 x PP2 dist checkpoint loaded at EP1 and at
TP2 x EP2 (expert-TP 2 and 1); LoRA on the experts (vs HF with the adapters merged); layout errors; the CPU
patches MoE layers need.

One torchrun launch (tests/dist/models_moe.py) runs every case; each test below asserts on one family of results.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_util import on_every_rank, run_cases

SCRIPT = Path(__file__).parent / "dist" / "models_moe.py"
ATOL = 1e-4
LAYOUTS = ("tp1pp1ep1", "tp2pp1ep1", "tp1pp2ep1", "tp1pp1ep2", "tp2pp1ep2", "tp1pp2ep2", "tp1pp1ep4",
           "tp2pp1ep2etp1")
DENSE_LAYOUTS = ("tp1pp1ep1", "tp2pp1ep1", "tp1pp2ep1")
MOE_CPU_PATCHES = ("cuda_streams", "backward_device_mode", "uneven_sequence_collectives", "splits_as_numpy",
                   "te_general_gemm")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_cases(SCRIPT, 4, tmp_path_factory.mktemp("models_moe"), timeout=900)


CASES = ([(layout, "qwen3_moe") for layout in LAYOUTS] + [(layout, "qwen3_tied") for layout in DENSE_LAYOUTS]
         + [(layout, "qwen3_moe_unnormed") for layout in ("tp1pp1ep1", "tp1pp1ep2")])


def test_moe_under_tp_with_sequence_parallelism_matches_hf(ranks):
    for what in ("log_probs", "entropy"):
        worst = max(on_every_rank(ranks, f"tp2pp1ep2sp/qwen3_moe/{what}"))
        assert worst <= ATOL, f"TP2 x EP2 + SP {what}: max |megatron - HF| = {worst}"


def test_expert_tensor_parallel_1_under_tp2_matches_hf_and_tp1(ranks):
    """expert_tensor_parallel_size=1 at TP2 x EP2: attention TP-sharded, each expert whole on one of the two TP
    ranks (EP over TP). Log-probs and entropy vs HF and the TP1 run to 1e-5, without and with sequence
    parallelism (training mode), and the gradients through the router and the experts vs HF autograd."""
    for layout in ("tp2pp1ep2etp1", "tp2pp1ep2etp1sp"):
        for what in ("log_probs", "log_probs_vs_tp1", "entropy"):
            worst = max(on_every_rank(ranks, f"{layout}/qwen3_moe/{what}"))
            assert worst <= 1e-5, f"{layout} {what}: {worst}"
    assert max(on_every_rank(ranks, "tp2pp1ep2etp1sp/qwen3_moe/grad")) <= 1e-5
    # megatron's expert layout: expert-TP 1 x EP 2 over each TP pair, expert-DP 2
    assert on_every_rank(ranks, "tp2pp1ep2etp1/qwen3_moe/local_experts") == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [r["tp2pp1ep2etp1/dims"] for r in ranks] == [[0, 0, 0, 0, 2, 2], [1, 0, 0, 1, 2, 2],
                                                           [0, 0, 1, 0, 2, 2], [1, 0, 1, 1, 2, 2]]


@pytest.mark.parametrize("layout, model", CASES)
def test_logits_and_logprobs_match_hf(ranks, layout, model):
    for what in ("logits", "log_probs", "entropy"):
        worst = max(on_every_rank(ranks, f"{layout}/{model}/{what}"))
        assert worst <= ATOL, f"{layout} {model} {what}: max |megatron - HF| = {worst}"


def test_experts_are_split_over_ep_ranks(ranks):
    # megatron's rank order: TP fastest, then DP (EP taken from it), then PP
    assert [r["tp2pp1ep2/dims"] for r in ranks] == [[0, 0, 0, 0, 2, 1], [1, 0, 0, 0, 2, 1], [0, 0, 1, 1, 2, 1],
                                                   [1, 0, 1, 1, 2, 1]]
    assert [r["tp1pp1ep2/dims"][3:] for r in ranks] == [[0, 4, 2], [1, 4, 2], [0, 4, 2], [1, 4, 2]]
    assert on_every_rank(ranks, "tp1pp1ep4/qwen3_moe/local_experts") == [[0], [1], [2], [3]]
    assert on_every_rank(ranks, "tp2pp1ep2/qwen3_moe/local_experts") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert on_every_rank(ranks, "tp1pp1ep1/qwen3_moe/local_experts") == [[0, 1, 2, 3]] * 4
    assert on_every_rank(ranks, "tp1pp1ep1/qwen3_tied/local_experts") == [[]] * 4


@pytest.mark.parametrize("layout", ("tp1pp1ep1", "tp1pp2ep1", "tp1pp1ep2", "tp1pp2ep2", "tp1pp1ep4", "tp2pp1ep2sp"))
def test_gradients_through_router_and_experts_match_hf(ranks, layout):
    # d(sum log-probs)/d(router weight, expert 3's down_proj) relative to HF autograd
    assert max(on_every_rank(ranks, f"{layout}/qwen3_moe/grad")) <= 1e-5


@pytest.mark.parametrize("layout, model", [("tp1pp2ep2", "qwen3_moe"), ("tp2pp1ep2", "qwen3_moe"),
                                           ("tp2pp1ep2etp1", "qwen3_moe"), ("tp1pp2ep1", "qwen3_tied")])
def test_hf_megatron_hf_roundtrip_is_bitwise(ranks, layout, model):
    assert all(on_every_rank(ranks, f"{layout}/{model}/export_names_equal"))
    assert all(on_every_rank(ranks, f"{layout}/{model}/export_bitwise"))  # every rank receives every full tensor
    assert all(on_every_rank(ranks, f"{layout}/{model}/bucket_order_same"))


@pytest.mark.parametrize("transport", ("collective", "shared_memory"))
@pytest.mark.parametrize("layout", ("tp1pp2ep2", "tp2pp1ep2etp1"))
def test_export_to_some_ranks_gathers_experts_from_every_ep_rank(ranks, transport, layout):
    assert all(on_every_rank(ranks, f"{layout}/destinations/{transport}"))


def test_ep2pp2_checkpoint_loads_at_ep1_and_tp2ep2(ranks):
    assert max(on_every_rank(ranks, "ckpt_ep2pp2_at_tp1pp1ep1/logits")) <= ATOL
    assert all(on_every_rank(ranks, "ckpt_ep2pp2_at_tp1pp1ep1/identical_to_hf_load"))
    assert max(on_every_rank(ranks, "ckpt_ep2pp2_at_tp2pp1ep2/logits")) <= ATOL
    assert max(on_every_rank(ranks, "ckpt_ep2pp2_at_tp2pp1ep2etp1/logits")) <= ATOL  # experts resharded to ETP 1


def test_convert_with_ep(ranks):
    assert on_every_rank(ranks, "convert/hf_to_mcore_rc") == [0] * 4
    assert on_every_rank(ranks, "convert/bad_ep_rc") == [2] * 4
    assert all(on_every_rank(ranks, "convert/ep1_logits_identical"))  # the TP2 x EP2 checkpoint at TP1 x EP1
    assert on_every_rank(ranks, "convert/mcore_to_hf_ep1_rc") == [0] * 4
    assert on_every_rank(ranks, "convert/mcore_to_hf_ep4_rc") == [0] * 4
    assert ranks[0]["convert/back_ep1_bitwise"] == "ok" and ranks[0]["convert/back_ep4_bitwise"] == "ok"


def test_layout_errors_name_ep(ranks):
    for err in on_every_rank(ranks, "bad_ep3_tp1"):
        assert "ep=3 does not divide the data-parallel size 4" in err
    for err in on_every_rank(ranks, "bad_ep4_tp2"):
        assert "ep=4 does not divide the data-parallel size 2" in err
    for err in on_every_rank(ranks, "dense_ep4_error"):
        assert "needs a MoE model" in err and "use ep=1" in err
    for err in on_every_rank(ranks, "experts6_ep4_error"):
        assert "ep=4 does not divide the model's 6 experts" in err


@pytest.mark.parametrize("layout", ["tp1pp1ep1", "tp1pp1ep2", "tp2pp1ep2etp1"])
def test_lora_on_the_experts_matches_hf_with_the_adapters_merged(ranks, layout):
    """LoRA on attention, the dense MLP and every expert (tests/dist/lora_moe.py): log-probs vs HF with the
    adapters merged by hand, B = 0 the base bitwise, the PEFT tensors gathered from every EP rank, the merged HF
    export, the adapters' gradients vs HF autograd through the merge (TP1 layouts), an EP2 dist checkpoint read
    at TP2 x EP2 with expert-TP 1."""
    for r in ranks:
        got = {k.split("/lora_moe/")[1]: v for k, v in r.items() if k.startswith(f"{layout}/lora_moe/")}
        ep = 2 if "ep2" in layout else 1
        assert len(got["expert_adapters"]) == 4 // ep and got["expert_adapters_not_allreduced"], got
        assert got["b0_equals_base"] and got["log_probs_vs_base"] > 0.1, got
        assert got["log_probs_vs_hf_merged"] <= 2e-5, got
        assert got["gathered_equal"] and got["export_names_equal"] and got["export_vs_hand_merge"] <= 1e-6, got
        if layout.startswith("tp1"):
            assert got["grad_rel"] <= 1e-4, got
        if layout == "tp2pp1ep2etp1":
            assert got["checkpoint_from_ep2_equal"], got


def test_every_moe_cpu_compat_patch_is_still_needed(ranks):
    from mppo.parallel.cpu_compat import PATCHES

    names = [p.name for p in PATCHES]
    assert set(MOE_CPU_PATCHES) <= set(names)
    for r in ranks:
        assert sorted(r["cpu_compat/installed_after"]) == sorted(names)
        for name in MOE_CPU_PATCHES:
            without = r[f"cpu_compat/{name}/without"]
            assert without != "no error", f"patch {name!r}: its call site works without it; remove the patch"
            assert r[f"cpu_compat/{name}/with"] == "ok", f"patch {name!r} does not make its call site work"
