"""Which transformer layer implementation to build: Transformer Engine, megatron-core's local layers with SDPA
attention, or megatron-core's local layers as they are.

`transformer_impl`:
- "auto": TE when CUDA is present and `transformer_engine` imports, else "sdpa";
- "te": Transformer Engine's layers (CUDA only; an error without CUDA or without the package);
- "sdpa": megatron-core's local layers with `mppo.models.attention.SDPAttention` as the core attention (fused
  flash / memory-efficient attention on CUDA and CPU, O(s) memory);
- "local": megatron-core's local layers; its DotProductAttention materialises [b, heads, s, s] scores.
  Kept as the reference the SDPA spec is tested against, and selectable.
Both local-layer specs take their norms from `TorchNorm` (the torch module megatron's WrappedTorchNorm builds, which
megatron refuses under sequence parallelism).

Each implementation is a builder in `SPEC_BUILDERS` taking the options of megatron's spec functions
(`get_gpt_layer_local_spec` / `get_gpt_layer_with_transformer_engine_spec`: e.g. num_experts, qk_layernorm), so a
new architecture option is one keyword passed through `gpt_layer_spec`. `gpt_decoder_spec` gives a decoder whose
layers differ (MoE layers beside dense ones, as in Qwen3-MoE's `mlp_only_layers`) one spec per layer of a stage.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Literal, Sequence

import torch

from mppo.errors import UserError

log = logging.getLogger("mppo")

TransformerImpl = Literal["auto", "te", "sdpa", "local"]
TRANSFORMER_IMPLS = ("auto", "te", "sdpa", "local")


class MissingGpuPackageError(UserError, ImportError):
    """A GPU-only package was asked for but is not importable here."""


def _transformer_engine_import_error() -> str | None:
    """Why `transformer_engine.pytorch` does not import here ("ImportError: ..."), or None when it does."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or OSError for missing CUDA/cuDNN libraries
        return f"{type(err).__name__}: {err}"
    return None


def _transformer_engine_imports() -> bool:
    return _transformer_engine_import_error() is None


@functools.cache
def _say_auto_fell_back(why: str) -> None:
    """Once per process (every model build resolves the setting): the CUDA run did not get TE, and why."""
    log.warning("transformer_impl=auto: Transformer Engine does not import on this CUDA machine (%s), so the models "
                "use megatron-core's local layers with SDPA attention (slower). Install it with pip install mppo[gpu], "
                "or set actor_rollout_ref.model.transformer_impl=sdpa to choose SDPA and silence this", why)


def transformer_engine_available() -> bool:
    """True when CUDA is present and Transformer Engine's torch extension imports."""
    return torch.cuda.is_available() and _transformer_engine_imports()


def resolve_transformer_impl(transformer_impl: TransformerImpl) -> Literal["te", "sdpa", "local"]:
    """The implementation a `transformer_impl` setting builds; raises MissingGpuPackageError when "te" cannot run."""
    if transformer_impl in ("sdpa", "local"):
        return transformer_impl
    if transformer_impl == "auto":
        if not torch.cuda.is_available():
            return "sdpa"  # TE has no CPU path: SDPA is the expected choice there, not news
        why = _transformer_engine_import_error()
        if why is None:
            return "te"
        _say_auto_fell_back(why)
        return "sdpa"
    if transformer_impl == "te":
        if not _transformer_engine_imports():
            raise MissingGpuPackageError(
                "transformer_impl='te' needs Transformer Engine, which does not import here: "
                "pip install mppo[gpu] on a CUDA machine (or use transformer_impl='sdpa')")
        if not torch.cuda.is_available():
            raise MissingGpuPackageError(
                "transformer_impl='te' needs a CUDA GPU (Transformer Engine has no CPU path); "
                "use transformer_impl='sdpa' or 'auto' on CPU")
        return "te"
    raise ValueError(f"transformer_impl must be one of {', '.join(repr(i) for i in TRANSFORMER_IMPLS)}, "
                     f"got {transformer_impl!r}")


def _te_spec(**options: Any):
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options)


def _local_spec(**options: Any):
    """megatron's local spec, its norms TorchNorm (sequence parallelism; the same torch module otherwise)."""
    from megatron.core.models.gpt import gpt_layer_specs

    return _with_torch_norm(gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", **options))


class TorchNorm:
    """megatron's WrappedTorchNorm (torch's RMSNorm or LayerNorm, the same module and numbers) that also builds under
    sequence parallelism, which megatron's refuses: there each TP rank normalises its slice of the sequence, so the
    weight's gradient is a partial sum, marked `sequence_parallel` for megatron's finalize_model_grads to all-reduce
    over TP (as its TE and apex norms are)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds or config.layernorm_zero_centered_gamma or config.persist_layer_norm:
            raise NotImplementedError(f"mppo's torch norm has {sorted(kinds)} without zero-centred gamma or "
                                      f"persistence, got {config.normalization}; use transformer_impl=te")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _with_torch_norm(spec: Any) -> Any:
    """`spec` (a ModuleSpec tree) with every WrappedTorchNorm replaced by TorchNorm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return TorchNorm
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _with_torch_norm(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not getattr(spec, k)})
    return spec


def _sdpa_spec(**options: Any):
    """The local spec with its core attention (DotProductAttention) replaced by SDPAttention."""
    from mppo.models.attention import SDPAttention

    layer = _local_spec(**options)
    attention = layer.submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))


SPEC_BUILDERS: dict[str, Callable[..., Any]] = {"te": _te_spec, "sdpa": _sdpa_spec, "local": _local_spec}


def gpt_layer_spec(transformer_impl: TransformerImpl = "auto", **options: Any):
    """megatron's GPT layer ModuleSpec for an RMSNorm/SwiGLU decoder layer. `options` go to megatron's spec
    function (num_experts, qk_layernorm, ...)."""
    return SPEC_BUILDERS[resolve_transformer_impl(transformer_impl)](**options)


def gpt_decoder_spec(config, transformer_impl: TransformerImpl = "auto", *, num_experts: int | None = None,
                     moe_layers: Sequence[int] = (), vp_stage: int | None = None, **options: Any):
    """The `transformer_layer_spec` for GPTModel: one layer spec when every layer is alike (dense, or MoE
    everywhere), else the block of this pipeline stage's (and virtual stage's) layers, each a MoE layer when its
    0-based global index is in `moe_layers`, with the final norm megatron gives a block built from one spec."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    impl = resolve_transformer_impl(transformer_impl)
    uniform = num_experts is None or len(moe_layers) == config.num_layers
    if uniform and impl == "te":
        return gpt_layer_spec(impl, num_experts=num_experts, **options)
    dense = gpt_layer_spec(impl, **options)
    moe = gpt_layer_spec(impl, num_experts=num_experts, **options) if num_experts is not None else dense
    if uniform:
        moe_layers = range(config.num_layers) if num_experts is not None else ()
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(first, first + get_num_layers_to_build(config, vp_stage=vp_stage))
    # the final norm: TE's with TE layers, else TorchNorm (megatron's default for a block would be WrappedTorchNorm)
    return TransformerBlockSubmodules(layer_specs=[moe if i in moe_layers else dense for i in layers],
                                      layer_norm=transformer_block.LayerNormImpl if impl == "te" else TorchNorm)
