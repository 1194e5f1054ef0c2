"""HF config.json -> the architecture facts megatron needs (TransformerConfig kwargs + GPTModel kwargs).

Supported: Qwen2 / Qwen2.5 (`qwen2`: QKV bias, RMSNorm, SwiGLU, GQA, rope base, tied or untied embeddings),
Llama 3 (`llama`: the same without QKV bias, optional `llama3` rope scaling), Qwen3 (`qwen3`: no QKV bias, RMSNorm
of each query/key head before rope, head_dim from the config) and Qwen3-MoE (`qwen3_moe`: Qwen3 attention, routed
SwiGLU experts behind a top-k softmax router, `norm_topk_prob`, dense layers from `decoder_sparse_step` /
`mlp_only_layers`, no shared expert). Both the transformers 4 layout (`rope_theta`, `rope_scaling`) and the
transformers 5 layout (`rope_parameters`) of config.json are read.

MoE variants that megatron-core could express but mppo does not map (shared experts, sigmoid or group-limited
routers, scaled routing weights) are refused here, naming the config.json key, before any model is built.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mppo.errors import UserError

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3", "qwen3_moe")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm over each query / key head before rope
MOE_MODEL_TYPES = ("qwen3_moe",)

# megatron-core's RotaryEmbedding hard-codes these llama3 rope-scaling constants; only `factor` is a parameter.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(UserError, ValueError):
    """The HF config describes a model (or a feature of one) that mppo cannot build."""


@dataclass(frozen=True)
class HFModelArgs:
    """What mppo needs to know about an HF causal LM, independent of how it is sharded."""

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int  # key/value heads
    head_dim: int
    qkv_bias: bool
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3 rope scaling; None when absent
    tie_word_embeddings: bool
    qk_layernorm: bool  # Qwen3: RMSNorm of each query and key head (over head_dim) before rope
    num_experts: int | None  # routed experts of a MoE layer; None for a dense model
    moe_topk: int  # experts per token (num_experts_per_tok); 0 for a dense model
    moe_ffn_hidden_size: int | None  # one expert's intermediate size (moe_intermediate_size)
    moe_norm_topk_prob: bool  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[int, ...]  # 0-based indices of the MoE layers (the others have a dense MLP)
    max_position_embeddings: int
    initializer_range: float
    torch_dtype: str | None
    raw: dict[str, Any]  # the config.json as read, written back unchanged by the HF exporter
    attention_dropout: float = 0.0  # as veRL's config converter: the HF config's, applied in updates only
    hidden_dropout: float = 0.0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope base, scaling dict or None) from either config.json layout."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(theta), scaling
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def _scaling_factor(model_type: str, scaling: dict[str, Any] | None) -> float | None:
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if model_type != "llama" or kind != "llama3":
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported for model_type {model_type!r}; mppo supports the 'llama3' "
            f"rope scaling of Llama 3 models only")
    for key, expected in _MEGATRON_LLAMA3_ROPE.items():
        if key in scaling and float(scaling[key]) != expected:
            raise UnsupportedModelError(
                f"llama3 rope scaling with {key}={scaling[key]} is not supported: megatron-core's rotary "
                f"embedding fixes {key}={expected} (only 'factor' is configurable)")
    return float(scaling["factor"])


# config.json keys of MoE variants mppo does not map, with the value that means "not used" (None: absent or null).
# Shared experts (Qwen2-MoE, DeepSeek), other routers (sigmoid scores, group-limited top-k, scaled weights).
_UNSUPPORTED_MOE_KEYS: dict[str, tuple[object, ...]] = {
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 1),
    "topk_group": (None, 1),
    "routed_scaling_factor": (None, 1, 1.0),
}


def _moe_facts(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The routed-expert facts of a qwen3_moe config.json (HFModelArgs fields)."""
    for key, unused in _UNSUPPORTED_MOE_KEYS.items():
        if cfg.get(key) not in unused:
            raise UnsupportedModelError(
                f"config.json has {key}={cfg[key]!r}: this MoE variant (shared experts or a router other than "
                f"top-k softmax) is not supported; mppo maps Qwen3-MoE's routed experts with a top-k softmax "
                f"router only (remove {key} or use a supported model)")
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    topk = cfg.get("num_experts_per_tok")
    if not experts or not topk:
        raise UnsupportedModelError("a qwen3_moe config.json needs num_experts and num_experts_per_tok > 0")
    experts, topk = int(experts), int(topk)
    if topk > experts:
        raise UnsupportedModelError(f"num_experts_per_tok={topk} is more than num_experts={experts}")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    if not moe_layers:
        raise UnsupportedModelError("this qwen3_moe config has no MoE layer (decoder_sparse_step / mlp_only_layers "
                                    "exclude them all); give it as a dense qwen3 model instead")
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=moe_layers)


_DENSE_FACTS = dict(num_experts=None, moe_topk=0, moe_ffn_hidden_size=None, moe_norm_topk_prob=False, moe_layers=())


def read_hf_config(source: str | Path | dict[str, Any]) -> HFModelArgs:
    """Read an HF model directory, a config.json path, or an already-loaded config dict."""
    if isinstance(source, dict):
        cfg = source
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"no HF config.json at {path}")
        cfg = json.loads(path.read_text())
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        # mppo builds its own models: a checkpoint's modelling code (auto_map) cannot add an architecture
        code = " (its auto_map code is not run: mppo builds its own models)" if cfg.get("auto_map") else ""
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported{code}; supported model types: "
                                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
        raise UnsupportedModelError(f"{model_type} with use_sliding_window=true is not supported; set it to false")
    if model_type == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModelError("Llama with attention_bias or mlp_bias is not supported")
    if model_type in QK_NORM_MODEL_TYPES and cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{model_type} with attention_bias=true is not supported (Qwen3 has no "
                                    "attention biases)")
    heads = int(cfg["num_attention_heads"])
    groups = int(cfg.get("num_key_value_heads") or heads)
    if heads % groups != 0:
        raise UnsupportedModelError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {groups}")
    theta, scaling = _rope(cfg)
    num_layers = int(cfg["num_hidden_layers"])
    moe = _moe_facts(cfg, num_layers) if model_type in MOE_MODEL_TYPES else _DENSE_FACTS
    return HFModelArgs(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        qkv_bias=model_type == "qwen2",
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling_factor=_scaling_factor(model_type, scaling),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_layernorm=model_type in QK_NORM_MODEL_TYPES,
        **moe,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        initializer_range=float(cfg.get("initializer_range", 0.02)),
        torch_dtype=cfg.get("torch_dtype", cfg.get("dtype")),
        raw=cfg,
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        hidden_dropout=float(cfg.get("hidden_dropout") or 0.0),
    )


def load_transformers_config(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """transformers' config object of an HF model directory (the CPU engine builds on it), never downloading; with
    the checkpoint's own code only under `trust_remote_code` (mppo.models.remote_code: without it, a config that
    needs its code stops in one line)."""
    from transformers import AutoConfig

    from mppo.models.remote_code import check_remote_code

    check_remote_code(model_dir, trust_remote_code)
    return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)


def transformer_config_kwargs(args: HFModelArgs) -> dict[str, Any]:
    """The architecture part of megatron's TransformerConfig (parallel/precision kwargs are the builder's)."""
    return dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=args.qkv_bias,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.initializer_range,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        qk_layernorm=args.qk_layernorm,
        **(moe_config_kwargs(args) if args.is_moe else {}),
    )


def moe_config_kwargs(args: HFModelArgs) -> dict[str, Any]:
    """TransformerConfig kwargs of Qwen3-MoE's routed experts (aux-loss coefficients are the trainer's).

    HF's router: softmax over all experts in fp32, top-k, and with norm_topk_prob the k weights renormalised.
    megatron's softmax router does exactly that with pre_softmax when the weights are not renormalised; without
    pre_softmax it takes the top-k logits and a softmax over those k, which is the renormalised top-k softmax.
    """
    return dict(
        num_moe_experts=args.num_experts,
        moe_router_topk=args.moe_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not args.moe_norm_topk_prob,
        moe_router_dtype="fp32",  # router logits and softmax in fp32 also for bf16 models
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,  # SequentialMLP: one MLP per local expert (HF's per-expert weights)
        moe_layer_freq=[int(i in args.moe_layers) for i in range(args.num_layers)],
    )


def gpt_model_kwargs(args: HFModelArgs) -> dict[str, Any]:
    """The architecture part of megatron's GPTModel kwargs (vocab size, stages and tying are the builder's)."""
    return dict(
        max_sequence_length=args.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=args.rope_theta,
        rope_scaling=args.rope_scaling_factor is not None,
        rope_scaling_factor=args.rope_scaling_factor if args.rope_scaling_factor is not None else 8.0,
    )


def hf_dtype(args: HFModelArgs) -> torch.dtype | None:
    """The dtype config.json declares for the weights, if any."""
    return getattr(torch, args.torch_dtype) if isinstance(args.torch_dtype, str) else None


# What makes a model "the same model" for a resume: its architecture as config.json states it.
MODEL_FACTS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def model_facts(model_path: str | Path) -> dict[str, Any]:
    """The architecture facts of the HF model at `model_path`, from its config.json (mppo.preflight has checked
    that there is one)."""
    config = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    facts = {key: config.get(key) for key in MODEL_FACTS}
    # dropout changes what an update computes; listed only when set, so older checkpoints of models without it resume
    facts.update({key: config[key] for key in ("attention_dropout", "hidden_dropout") if config.get(key)})
    return facts
