"""Single-process checks of mppo.models: HF config reading, vocab padding, bucketing, layer-spec choice, padding
micro-batches, layout validation. Expected values are written out by hand from the HF/megatron conventions."""
from __future__ import annotations

import sys

import pytest
import torch

from mppo.models.hf_config import UnsupportedModelError, gpt_model_kwargs, read_hf_config, transformer_config_kwargs
from mppo.models.vocab import mask_padded_logits, padded_vocab_size, valid_vocab_size_per_rank
from mppo.models.weights import bucketed

QWEN2 = {  # the shape of a transformers-4 Qwen2.5 config.json
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "max_position_embeddings": 32768,
    "hidden_act": "silu", "use_sliding_window": False, "torch_dtype": "bfloat16",
}
LLAMA3 = {  # transformers-5 layout (rope_parameters)
    "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "max_position_embeddings": 131072, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
}


def test_qwen2_config_maps_to_megatron():
    args = read_hf_config(QWEN2)
    tc = transformer_config_kwargs(args)
    assert (tc["num_layers"], tc["hidden_size"], tc["ffn_hidden_size"]) == (24, 896, 4864)
    assert (tc["num_attention_heads"], tc["num_query_groups"], tc["kv_channels"]) == (14, 2, 64)
    assert tc["normalization"] == "RMSNorm" and tc["layernorm_epsilon"] == 1e-6
    assert tc["gated_linear_unit"] and tc["activation_func"] is torch.nn.functional.silu
    assert tc["add_qkv_bias"] and not tc["add_bias_linear"]
    gm = gpt_model_kwargs(args)
    assert gm["rotary_base"] == 1e6 and gm["position_embedding_type"] == "rope" and not gm["rope_scaling"]
    assert args.tie_word_embeddings and args.torch_dtype == "bfloat16" and args.heads_per_group == 7


def test_dropout_comes_from_the_hf_config_as_in_verl():
    """veRL's config converter: attention_dropout from the HF config, hidden_dropout where the config has one;
    absent (most configs) means none. The trainer applies it in updates only (mppo.workers.pipeline)."""
    assert (transformer_config_kwargs(read_hf_config(QWEN2))["attention_dropout"],
            transformer_config_kwargs(read_hf_config(QWEN2))["hidden_dropout"]) == (0.0, 0.0)
    tc = transformer_config_kwargs(read_hf_config({**QWEN2, "attention_dropout": 0.1, "hidden_dropout": 0.05}))
    assert (tc["attention_dropout"], tc["hidden_dropout"]) == (0.1, 0.05)


def test_llama3_config_with_rope_scaling():
    args = read_hf_config(LLAMA3)
    tc = transformer_config_kwargs(args)
    assert not tc["add_qkv_bias"] and tc["kv_channels"] == 64 and tc["num_query_groups"] == 8
    gm = gpt_model_kwargs(args)
    assert gm["rotary_base"] == 500000.0 and gm["rope_scaling"] and gm["rope_scaling_factor"] == 32.0
    assert args.torch_dtype == "bfloat16"
    v4 = {k: v for k, v in LLAMA3.items() if k != "rope_parameters"}
    v4.update(rope_theta=500000.0, rope_scaling={"type": "llama3", "factor": 8.0})
    assert read_hf_config(v4).rope_scaling_factor == 8.0
    plain = {**v4, "rope_scaling": None}
    assert read_hf_config(plain).rope_scaling_factor is None
    assert not gpt_model_kwargs(read_hf_config(plain))["rope_scaling"]


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "supported model types: qwen2, llama"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_qwen2_variants(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_hf_config({**QWEN2, **change})


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0}, "low_freq_factor"),
    ({"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}, "'yarn' is not supported"),
])
def test_unsupported_rope_scaling(rope, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_hf_config({**LLAMA3, "rope_parameters": rope})


def test_llama_with_biases_is_rejected():
    with pytest.raises(UnsupportedModelError, match="attention_bias"):
        read_hf_config({**LLAMA3, "attention_bias": True})


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("vocab, tp, divisible, padded", [
    (1003, 1, 128, 1024), (1003, 2, 128, 1024), (1003, 8, 128, 1024), (151936, 4, 128, 151936),
    (1000, 3, 128, 1152), (128, 2, 128, 128), (129, 1, 64, 192),
])
def test_padded_vocab_size(vocab, tp, divisible, padded):
    assert padded_vocab_size(vocab, tp, divisible) == padded
    assert padded % tp == 0


def test_valid_vocab_size_per_rank():
    # 1003 real tokens in 1024 rows over 2 ranks: 512 + 491
    assert [valid_vocab_size_per_rank(1003, 1024, r, 2) for r in range(2)] == [512, 491]
    # 100 real tokens in 512 rows over 4 ranks: rank 0 holds them all
    assert [valid_vocab_size_per_rank(100, 512, r, 4) for r in range(4)] == [100, 0, 0, 0]
    assert [valid_vocab_size_per_rank(1000, 1024, r, 4) for r in range(4)] == [256, 256, 256, 232]


def test_masked_padded_logits_equal_softmax_over_real_vocab():
    logits = torch.randn(5, 16)
    masked = mask_padded_logits(logits, 11)
    assert torch.allclose(torch.log_softmax(masked, -1)[:, :11], torch.log_softmax(logits[:, :11], -1), atol=1e-6)
    p = torch.softmax(masked, -1)
    entropy = -(p * torch.log_softmax(masked, -1)).sum(-1)
    ref = torch.distributions.Categorical(logits=logits[:, :11]).entropy()
    assert torch.isfinite(entropy).all() and torch.allclose(entropy, ref, atol=1e-5)
    assert mask_padded_logits(logits, 16) is logits  # nothing to mask


def test_bucketed_respects_the_limit_and_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate([10, 20, 5, 100, 1, 1, 30])]
    buckets = list(bucketed(iter(tensors), bucket_bytes=120))  # 30 floats
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"], ["t6"]]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in tensors]
    for b in buckets:  # only a tensor larger than the limit may exceed it, alone
        assert len(b) == 1 or sum(t.numel() * 4 for _, t in b) <= 120
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucketed(iter(tensors), 0))


def test_transformer_engine_requested_without_it():
    from mppo.models.spec import MissingGpuPackageError, resolve_transformer_impl

    with pytest.raises(MissingGpuPackageError, match=r"pip install mppo\[gpu\]"):
        resolve_transformer_impl("te")
    assert resolve_transformer_impl("auto") == "sdpa"  # no Transformer Engine here: SDPA attention
    assert resolve_transformer_impl("sdpa") == "sdpa"
    assert resolve_transformer_impl("local") == "local"
    with pytest.raises(ValueError, match="'auto', 'te', 'sdpa', 'local'"):
        resolve_transformer_impl("apex")


def test_auto_says_once_why_a_cuda_machine_gets_sdpa(monkeypatch, caplog):
    """On CUDA, `auto` without an importable Transformer Engine builds SDPA layers and logs the import error once
    (the warning is per process: actor, critic and reference each resolve the setting). Transformer Engine is not
    installed here, so its import fails for real; only CUDA's presence is pretended."""
    import logging

    from mppo.models import spec

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # a machine where it does not import
    spec._say_auto_fell_back.cache_clear()
    with caplog.at_level(logging.WARNING, logger="mppo"):
        assert [spec.resolve_transformer_impl("auto") for _ in range(3)] == ["sdpa"] * 3
    said = [r.getMessage() for r in caplog.records if "transformer_impl=auto" in r.getMessage()]
    assert len(said) == 1, said
    assert "Transformer Engine does not import" in said[0] and "No module named" in said[0]
    assert "transformer_impl=sdpa" in said[0] and "mppo[gpu]" in said[0]
    spec._say_auto_fell_back.cache_clear()


def test_check_layout():
    from mppo.parallel import ParallelLayoutError, check_layout

    assert check_layout(8, 2, 2) == 2 and check_layout(4, 1, 2, 2) == 2
    with pytest.raises(ParallelLayoutError, match="not divisible by tp\\*pp = 3\\*1"):
        check_layout(4, 3, 1)
    with pytest.raises(ParallelLayoutError, match="needs pp >= 2"):
        check_layout(4, 2, 1, 2)
    assert check_layout(8, 2, 1, ep=4) == 4 and check_layout(8, 1, 2, ep=2) == 4
    with pytest.raises(ParallelLayoutError, match="ep=4 does not divide the data-parallel size 2"):
        check_layout(8, 2, 2, ep=4)


QWEN3 = {  # the shape of Qwen3-0.6B's config.json: head_dim 128 != hidden / heads = 64
    "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True, "max_position_embeddings": 40960,
    "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
}
QWEN3_MOE = {  # the shape of Qwen3-30B-A3B's config.json
    **QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
}


def test_qwen3_config_maps_to_megatron():
    args = read_hf_config(QWEN3)
    tc = transformer_config_kwargs(args)
    assert tc["qk_layernorm"] and not tc["add_qkv_bias"] and tc["kv_channels"] == 128
    assert "num_moe_experts" not in tc and not args.is_moe and args.moe_layers == ()


def test_qwen3_moe_config_maps_to_megatron():
    args = read_hf_config(QWEN3_MOE)
    tc = transformer_config_kwargs(args)
    assert args.is_moe and tc["qk_layernorm"]
    assert (tc["num_moe_experts"], tc["moe_router_topk"], tc["moe_ffn_hidden_size"]) == (128, 8, 768)
    # renormalised top-k softmax = softmax over the top-k logits (megatron without pre-softmax)
    assert tc["moe_router_pre_softmax"] is False and tc["moe_router_score_function"] == "softmax"
    assert tc["moe_token_dispatcher_type"] == "alltoall" and tc["moe_layer_freq"] == [1] * 48
    unnormed = read_hf_config({**QWEN3_MOE, "norm_topk_prob": False})
    assert transformer_config_kwargs(unnormed)["moe_router_pre_softmax"] is True
    # transformers 5 writes num_local_experts; dense layers from decoder_sparse_step and mlp_only_layers
    mixed = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    mixed.update(num_local_experts=8, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    args = read_hf_config(mixed)
    assert args.num_experts == 8 and args.moe_layers == (1, 5)
    assert transformer_config_kwargs(args)["moe_layer_freq"] == [0, 1, 0, 0, 0, 1]


@pytest.mark.parametrize("change, key", [
    ({"shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size"),
    ({"n_shared_experts": 1}, "n_shared_experts"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"n_group": 8, "topk_group": 4}, "n_group"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
])
def test_unsupported_moe_variants_name_the_key(change, key):
    with pytest.raises(UnsupportedModelError, match=f"config.json has {key}=.*not supported"):
        read_hf_config({**QWEN3_MOE, **change})
    # the values that mean "not used" are accepted
    read_hf_config({**QWEN3_MOE, "shared_expert_intermediate_size": 0, "scoring_func": "softmax", "n_group": 1})


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "attention_bias"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 200}, "more than num_experts"),
    ({"mlp_only_layers": list(range(48))}, "no MoE layer"),
])
def test_unsupported_qwen3_variants(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        read_hf_config({**QWEN3_MOE, **change})
