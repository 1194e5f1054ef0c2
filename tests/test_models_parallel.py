"""Megatron actor/critic/ref vs HF transformers at TP2xPP2, TP2, PP2, TP1 and interleaved PP (4 CPU ranks), with the
SDPA attention spec (transformer_impl=auto on CPU) and megatron's local spec as a reference.

One torchrun launch (tests/dist/models_parallel.py) runs every case; each test below asserts on one family of
results from all ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from dist_util import on_every_rank, run_cases

SCRIPT = Path(__file__).parent / "dist" / "models_parallel.py"
ATOL = 1e-4
MODELS = ("qwen2_untied", "qwen2_tied", "llama_tied", "llama_untied")
LAYOUTS = ("tp2pp2", "tp2pp1", "tp1pp2", "tp1pp1", "tp1pp2vpp2")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_cases(SCRIPT, 4, tmp_path_factory.mktemp("models_parallel"), timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_logits_and_logprobs_match_hf(ranks, layout, model):
    if layout == "tp1pp2vpp2" and model == "llama_untied":  # 2 layers cannot fill 4 virtual chunks
        assert all("pp=2 x vpp=2" in v for v in on_every_rank(ranks, f"{layout}/{model}/layout_error"))
        return
    # the default build on CPU (transformer_impl=auto, no Transformer Engine) is the SDPA attention spec
    assert set(on_every_rank(ranks, f"{layout}/{model}/core_attention")) == {"SDPAttention"}
    for what in ("logits", "log_probs", "entropy"):
        worst = max(on_every_rank(ranks, f"{layout}/{model}/{what}"))
        assert worst <= ATOL, f"{layout} {model} {what}: max |megatron - HF| = {worst}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", ("qwen2_untied", "llama_tied"))
def test_local_spec_reference_matches_hf_and_sdpa(ranks, layout, model):
    """megatron's own DotProductAttention (transformer_impl=local) at the same layouts: equal to HF, and the SDPA
    spec equal to it."""
    assert set(on_every_rank(ranks, f"{layout}/{model}/local/core_attention")) == {"DotProductAttention"}
    for what in ("logits", "log_probs"):
        worst = max(on_every_rank(ranks, f"{layout}/{model}/local/{what}"))
        assert worst <= ATOL, f"{layout} {model} local {what}: max |megatron - HF| = {worst}"
    assert max(on_every_rank(ranks, f"{layout}/{model}/local/logits_vs_sdpa")) <= 1e-5


def test_llama3_rope_scaling_is_exercised(ranks):
    # Without rope scaling HF's logits move by far more than the tolerance, so the llama_tied cases test it.
    assert ranks[0]["rope_scaling_effect"] > 10 * ATOL


def test_layouts_and_gloo_settings(ranks):
    assert [r["tp2pp2/dims"][:3] for r in ranks] == [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
    assert [r["tp1pp1/dims"] for r in ranks] == [[0, 0, i, 4] for i in range(4)]
    for layout in LAYOUTS:
        assert not any(on_every_rank(ranks, f"{layout}/batch_p2p_comm")), "gloo must not batch p2p ops"
    for err in on_every_rank(ranks, "bad_layout_error"):
        assert "not divisible by tp*pp" in err


@pytest.mark.parametrize("layout", ("tp2pp2", "tp2pp1", "tp1pp2", "tp1pp1"))
@pytest.mark.parametrize("model", ("qwen2_untied", "qwen2_tied", "llama_tied"))
def test_critic_values_match_hf_hidden_states(ranks, layout, model):
    worst = max(on_every_rank(ranks, f"{layout}/{model}/values"))
    assert worst <= ATOL, f"{layout} {model}: max |values - HF hidden @ head| = {worst}"
    key = f"{layout}/{model}/critic_head_zero_init"
    heads = [r[key] for r in ranks if key in r]
    assert heads and all(heads), "the value head must start at zero"
    assert all(r[f"{layout}/{model}/critic_head_dtype"] == "torch.float32" for r in ranks
               if f"{layout}/{model}/critic_head_dtype" in r)


def test_critic_exports_and_reloads_as_hf_score_head(ranks):
    assert on_every_rank(ranks, "tp2pp2/qwen2_untied/critic_roundtrip") == ["ok"] * 4


def test_critic_checkpoint_saved_at_tp2pp2_loads_at_tp1(ranks):
    assert max(on_every_rank(ranks, "tp1pp1/qwen2_untied/critic_ckpt_values")) <= ATOL


@pytest.mark.parametrize("layout", ("tp2pp2", "tp1pp2vpp2"))
def test_forward_backward_gradient_matches_hf(ranks, layout):
    # Relative error of d(sum log-probs + 0.1 entropy)/d(final norm and layer-0 norm weights) vs HF autograd.
    worst = max(on_every_rank(ranks, f"{layout}/qwen2_tied/final_norm_grad"))
    assert worst <= 1e-5


def test_interleaved_schedule_rejects_uneven_micro_batches(ranks):
    for err in on_every_rank(ranks, "tp1pp2vpp2/qwen2_tied/uneven_shapes_error"):
        assert "needs micro-batches of one shape" in err and "pipeline_inputs" in err  # names the fix


@pytest.mark.parametrize("model", MODELS)
def test_hf_megatron_hf_roundtrip_is_bitwise(ranks, model):
    assert all(on_every_rank(ranks, f"tp2pp2/{model}/export_names_equal"))
    assert all(on_every_rank(ranks, f"tp2pp2/{model}/export_bitwise"))  # every rank receives every full tensor
    assert ranks[0][f"tp2pp2/{model}/roundtrip_files_bitwise"] == "ok"
    assert all(on_every_rank(ranks, f"tp2pp2/{model}/bucket_order_same"))
    assert max(on_every_rank(ranks, f"tp2pp2/{model}/bucket_max_bytes")) <= 40_000


@pytest.mark.parametrize("model", ("qwen2_untied", "llama_tied"))
def test_convert_tp2pp2_checkpoint_loads_at_tp1(ranks, model):
    assert on_every_rank(ranks, f"convert/{model}/hf_to_mcore_rc") == [0] * 4
    assert on_every_rank(ranks, f"convert/{model}/exists_again_rc") == [2] * 4  # refuses to overwrite
    assert max(on_every_rank(ranks, f"convert/{model}/tp1_logits_vs_hf")) <= ATOL
    assert all(on_every_rank(ranks, f"convert/{model}/tp1_logits_identical"))
    assert on_every_rank(ranks, f"convert/{model}/mcore_to_hf_rc") == [0] * 4
    assert ranks[0][f"convert/{model}/back_bitwise"] == "ok"


def test_every_cpu_compat_patch_is_still_needed(ranks):
    from mppo.parallel.cpu_compat import PATCHES
    from test_models_moe import MOE_CPU_PATCHES  # probed at EP2 by tests/dist/models_moe.py

    names = [p.name for p in PATCHES]
    dense = [name for name in names if name not in MOE_CPU_PATCHES]
    for r in ranks:
        assert r["cpu_compat/patches"] == names
        assert r["cpu_compat/installed"] == names and sorted(r["cpu_compat/installed_after"]) == sorted(names)
        assert r["cpu_compat/probed"] == dense
        for name in dense:
            without = r[f"cpu_compat/{name}/without"]
            assert without not in ("no error", "no probe for this patch"), \
                f"patch {name!r}: its call site works without it ({without}); remove the patch"
            assert r[f"cpu_compat/{name}/with"] == "ok", f"patch {name!r} does not make its call site work"
    import importlib.metadata

    from mppo.versions import MEGATRON_CORE_PROVEN_ON

    installed = importlib.metadata.version("megatron-core")
    assert installed == MEGATRON_CORE_PROVEN_ON, (
        f"the probes above ran on megatron-core {installed}, mppo/versions.py says they were proven on "
        f"{MEGATRON_CORE_PROVEN_ON}: if they all passed, set MEGATRON_CORE_PROVEN_ON (and the supported range)")


LORA_LAYOUTS = ("tp2pp2", "tp2pp1", "tp1pp2", "tp1pp1")


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_lora_matches_hf_peft_and_tp1(ranks, layout):
    """LoRA (all-linear, per-projection adapters on the fused linear_qkv / linear_fc1) loaded from one set of full
    PEFT tensors at each layout: log-probs and gradients equal HF + those tensors as a PEFT adapter, and TP1."""
    key = f"{layout}/qwen2_untied/lora"
    assert min(on_every_rank(ranks, f"{key}/effect")) > 0.1  # the adapters change the model, so this tests them
    assert max(on_every_rank(ranks, f"{key}/log_probs_vs_peft")) <= 1e-5
    assert max(on_every_rank(ranks, f"{key}/logits_vs_peft")) <= 1e-4
    assert max(on_every_rank(ranks, f"{key}/log_probs_vs_tp1")) <= 1e-5
    assert max(on_every_rank(ranks, f"{key}/grad_vs_hf")) <= 1e-5  # relative, over every adapter tensor
    if layout.startswith("tp2"):  # sequence parallelism: the adapters' SP collectives and SP-partial grads
        assert max(on_every_rank(ranks, f"{key}/sp_log_probs_vs_peft")) <= 1e-5
        assert max(on_every_rank(ranks, f"{key}/sp_grad_vs_hf")) <= 1e-5


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_lora_b0_and_disabled_equal_the_base_and_export_is_peft_and_merged(ranks, layout):
    key = f"{layout}/qwen2_untied/lora"
    assert all(on_every_rank(ranks, f"{key}/base_frozen"))  # only adapter parameters require grad
    assert all(on_every_rank(ranks, f"{key}/b0_bitwise"))  # B = 0 at start: the base exactly
    assert all(on_every_rank(ranks, f"{key}/disabled_bitwise"))  # adapters_disabled: the reference = the base
    assert all(on_every_rank(ranks, f"{key}/gather_bitwise"))  # TP shards -> the full PEFT tensors back
    assert all(on_every_rank(ranks, f"{key}/merged_export_names"))
    assert max(on_every_rank(ranks, f"{key}/merged_export_vs_by_hand")) <= 1e-6  # W + B @ A * alpha / r
