"""Tiny random HF causal LMs (Qwen2, Llama 3, Qwen3, Qwen3-MoE) saved with safetensors, for the model tests.

Every parameter is redrawn (norm weights around 1, biases non-zero) so that a wrong mapping of any tensor
shows up in the logits.
"""
from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-6)

# name -> (model_type, config overrides)
MODELS = {
    "qwen2_untied": ("qwen2", dict(vocab_size=1003, num_hidden_layers=4, tie_word_embeddings=False,
                                   rope_theta=1e6)),
    "qwen2_tied": ("qwen2", dict(vocab_size=1000, num_hidden_layers=4, tie_word_embeddings=True)),
    "llama_tied": ("llama", dict(vocab_size=1003, num_hidden_layers=4, tie_word_embeddings=True,
                                 rope_theta=500000.0,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192})),
    "llama_untied": ("llama", dict(vocab_size=1001, num_hidden_layers=2, tie_word_embeddings=False)),
}

# Qwen3 dense and Qwen3-MoE (tests/dist/models_moe.py): head_dim 32 != hidden / heads = 16 as in real Qwen3 configs;
# 4 experts, top-2; one dense layer (mlp_only_layers) so that a block of MoE and dense layers is built.
QWEN3_TINY = dict(TINY, head_dim=32)
QWEN3_MODELS = {
    "qwen3_tied": ("qwen3", dict(vocab_size=1003, num_hidden_layers=4, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3_moe": ("qwen3_moe", dict(vocab_size=1001, num_hidden_layers=4, tie_word_embeddings=False,
                                    moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                    norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe_unnormed": ("qwen3_moe", dict(vocab_size=1000, num_hidden_layers=2, tie_word_embeddings=True,
                                             moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                             norm_topk_prob=False)),
}

# A Qwen3-MoE of the kind SGLang 0.5.23 serves (docs/MOE.md): every layer MoE, untied head (its
# Qwen3MoeForCausalLM ignores mlp_only_layers and tie_word_embeddings); unnormalised top-k weights.
SGLANG_QWEN3_MOE = {"qwen3_moe_sglang": ("qwen3_moe", dict(vocab_size=1001, num_hidden_layers=2,
                                                           tie_word_embeddings=False, moe_intermediate_size=48,
                                                           num_experts=4, num_experts_per_tok=2,
                                                           norm_topk_prob=False))}


def hf_config(name: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if name in QWEN3_MODELS or name in SGLANG_QWEN3_MOE:
        model_type, overrides = {**QWEN3_MODELS, **SGLANG_QWEN3_MOE}[name]
        return (Qwen3Config if model_type == "qwen3" else Qwen3MoeConfig)(**QWEN3_TINY, **overrides)
    model_type, overrides = MODELS[name]
    cls = Qwen2Config if model_type == "qwen2" else LlamaConfig
    return cls(**TINY, **overrides)


def make_hf_model(name: str, out_dir: Path, seed: int = 0):
    """Create, randomise and save one tiny model; return it (fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager",
                                             dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


def save_tiny_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer over made-up tokens, so that exporters have tokenizer files to carry along."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out_dir)


def load_hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
