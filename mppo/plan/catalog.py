"""Built-in facts the planner needs before anything is downloaded: a few public HF configs and GPU data sheets.

The model entries are the architecture fields of each model's public config.json on the Hugging Face hub (the
numbers that decide memory and FLOPs); `-Instruct` variants share their base model's architecture, so a lookup
of "Qwen2.5-7B-Instruct" finds "Qwen2.5-7B". Device figures are vendor data-sheet numbers (SXM parts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mppo.config import ConfigError

GiB = 1 << 30

_QWEN2 = {"model_type": "qwen2", "hidden_act": "silu", "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 32768, "use_sliding_window": False, "torch_dtype": "bfloat16"}

_QWEN3 = {"model_type": "qwen3", "hidden_act": "silu", "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 40960, "use_sliding_window": False, "torch_dtype": "bfloat16",
          "head_dim": 128, "vocab_size": 151936, "attention_bias": False}

# name -> config.json fields (public values; model_type decides QKV bias: qwen2 has it, llama does not)
KNOWN_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {**_QWEN2, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "Qwen2.5-1.5B": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "Qwen2.5-3B": {**_QWEN2, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                   "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936,
                   "tie_word_embeddings": True},
    "Qwen2.5-7B": {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "Qwen2.5-32B": {**_QWEN2, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False},
    "Llama-3-8B": {"model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                   "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "Qwen3-0.6B": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "Qwen3-30B-A3B": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": []},
}


def known_config(name: str) -> tuple[str, dict[str, Any]]:
    """(canonical name, config.json dict) of a built-in model; case-insensitive, `-Instruct` ignored."""
    wanted = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    wanted = wanted[: -len("-instruct")] if wanted.endswith("-instruct") else wanted
    for key, cfg in KNOWN_HF_CONFIGS.items():
        if key.lower() == wanted:
            return key, dict(cfg)
    raise ConfigError(f"no built-in HF config named '{name}'; built-in: {', '.join(KNOWN_HF_CONFIGS)} "
                      "(or point actor_rollout_ref.model.path at a directory with the model's config.json)")


@dataclass(frozen=True)
class DeviceSpec:
    """What the planner assumes about one accelerator (or one CPU rank)."""

    name: str
    memory_bytes: int  # usable memory per device, as torch.cuda.get_device_properties().total_memory reports it
    hbm_bytes_per_s: float | None  # memory bandwidth (decode speed); None: unknown (CPU)
    peak_flops: float | None  # dense bf16 tensor-core peak; None: unknown (CPU)


DEVICES: dict[str, DeviceSpec] = {
    # nominal 80 GB / 141 GB; torch sees ~79.2 GiB / ~139.7 GiB of it. 989 TFLOP/s dense bf16 (SXM).
    "h100": DeviceSpec("H100 SXM 80GB", int(79.2 * GiB), 3.35e12, 989e12),
    "h200": DeviceSpec("H200 SXM 141GB", int(139.7 * GiB), 4.8e12, 989e12),
}
