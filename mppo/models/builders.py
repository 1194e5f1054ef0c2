"""Build the actor, critic and reference models as megatron-core GPTModels, one per virtual-pipeline chunk.

- actor: GPTModel with a vocab-parallel output layer (logits over the padded vocabulary).
- critic: the same trunk; on the last stage the output layer is a replicated hidden->1 value head in fp32.
- ref: an actor that is frozen (no grads, eval mode).

Weights are random after building; load HF weights with `mppo.models.weights.load_hf_weights` or a dist
checkpoint with `mppo.models.checkpoint.load_model_checkpoint`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from mppo.models.hf_config import HFModelArgs, gpt_model_kwargs, read_hf_config, transformer_config_kwargs
from mppo.models.spec import TransformerImpl, gpt_decoder_spec, resolve_transformer_impl
from mppo.models.vocab import padded_vocab_size
from mppo.parallel import ParallelDims, ParallelLayoutError

Role = Literal["actor", "critic", "ref"]
ROLES = ("actor", "critic", "ref")


class ValueHead(nn.Module):
    """Replicated hidden -> 1 projection computed in fp32, zero-initialised, standing in for GPTModel.output_layer.
    Its parameters take the model's dtype like every other (build_gpt_model casts them; the optimizer keeps fp32
    main copies), the product is taken in fp32.

    Its parameters are called `weight` and `bias` so that GPTModel/LanguageModule.sharded_state_dict finds them
    under `output_layer.weight` / `output_layer.bias`. It takes the output layer's call signature and returns
    (values [s, b, 1], None) like ColumnParallelLinear returns (logits, bias).
    """

    def __init__(self, hidden_size: int, device: torch.device | str | None = None, sequence_parallel: bool = False):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.zeros(1, hidden_size, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=torch.float32, device=device))

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            # [s/tp, b, h] -> [s, b, h]: every TP rank then holds all values and the same head gradient
            hidden_states = gather_sequence(hidden_states)
        return nn.functional.linear(hidden_states.float(), self.weight.float(), self.bias.float()), None


def build_transformer_config(args: HFModelArgs, dims: ParallelDims, *, dtype: torch.dtype = torch.float32,
                             **overrides):
    """megatron TransformerConfig for this architecture and layout. `overrides` go to TransformerConfig as is."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = dims.device.type == "cuda"
    if args.num_query_groups % dims.tp != 0:
        raise ParallelLayoutError(
            f"tp={dims.tp} does not divide the model's {args.num_query_groups} key/value heads; pick a tp that does")
    if args.is_moe and args.num_experts % dims.ep != 0:
        raise ParallelLayoutError(
            f"expert parallel size ep={dims.ep} does not divide the model's {args.num_experts} experts; pick an ep "
            f"that divides {args.num_experts}")
    if not args.is_moe and dims.ep > 1:
        raise ParallelLayoutError(f"ep={dims.ep} needs a MoE model, this {args.model_type} model is dense; use ep=1")
    if dims.cp > 1 and args.is_moe:
        raise ParallelLayoutError(f"context parallelism (cp={dims.cp}) is not supported for MoE models (routing "
                                  "replay and the router losses are not split over CP ranks); use cp=1")
    chunks = dims.pp * dims.num_model_chunks
    if args.num_layers % chunks != 0:
        raise ParallelLayoutError(
            f"{args.num_layers} layers cannot be split evenly over pp={dims.pp} x vpp={dims.num_model_chunks} "
            f"chunks; pick pp/vpp whose product divides {args.num_layers}")
    kwargs = transformer_config_kwargs(args)
    kwargs.update(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.expert_tp,
        context_parallel_size=dims.cp,
        # Transformer Engine's CP (transformer_impl=te): all-gathered K/V, as mppo's SDPA attention does (small under
        # grouped-query attention, exact causal masks); TE's default would be the p2p ring
        cp_comm_type="all_gather" if dims.cp > 1 else None,
        virtual_pipeline_model_parallel_size=dims.vpp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Micro-batches may differ in shape (token-budget batching): send shapes before activations. Not with
        # the interleaved schedule: at pp=2 its shape exchange pairs the two directions' messages wrongly
        # (one batch_isend_irecv to the same peer both ways), so there micro-batches must share one shape.
        variable_seq_lengths=dims.vpp is None,
        # MoE models use the all-to-all dispatcher (hf_config.moe_config_kwargs); for dense ones the key only
        # satisfies a check tied to variable_seq_lengths
        moe_token_dispatcher_type="alltoall",
        # gloo: batched isend/irecv in the interleaved schedule gave silently wrong activations.
        batch_p2p_comm=dims.backend != "gloo",
    )
    kwargs.update(overrides)
    if kwargs.get("sequence_parallel") and dims.tp < 2:
        raise ParallelLayoutError("sequence parallelism splits the sequence over the TP ranks and needs tp > 1; "
                                  "set sequence_parallel=false (or null) at tp=1")
    return TransformerConfig(**kwargs)


def build_gpt_model(hf: HFModelArgs | str | Path, dims: ParallelDims, *, role: Role = "actor",
                    dtype: torch.dtype = torch.float32, transformer_impl: TransformerImpl = "auto",
                    make_vocab_size_divisible_by: int = 128, **config_overrides) -> list[nn.Module]:
    """One GPTModel per virtual-pipeline chunk of this rank (a list of one without vpp), on `dims.device`.

    `hf` is an HF model directory, config.json path, or parsed HFModelArgs. The critic never ties its head to
    the embedding (the head is a separate hidden->1 projection); actor and ref tie when the HF model does.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    args = hf if isinstance(hf, HFModelArgs) else read_hf_config(hf)
    config = build_transformer_config(args, dims, dtype=dtype, **config_overrides)
    vocab = padded_vocab_size(args.vocab_size, dims.tp, make_vocab_size_divisible_by)
    tie = args.tie_word_embeddings and role != "critic"

    if dims.cp > 1 and resolve_transformer_impl(transformer_impl) == "local":
        raise ParallelLayoutError(f"context parallelism (cp={dims.cp}) needs transformer_impl=sdpa or te: megatron's "
                                  "local DotProductAttention has none")
    chunks: list[nn.Module] = []
    for vp_stage in range(dims.num_model_chunks):
        vp = vp_stage if dims.vpp else None
        spec = gpt_decoder_spec(config, transformer_impl, num_experts=args.num_experts, moe_layers=args.moe_layers,
                                qk_layernorm=args.qk_layernorm, vp_stage=vp)
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=vocab,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=True, share_embeddings_and_output_weights=tie, vp_stage=vp,
            **gpt_model_kwargs(args))
        if role == "critic" and model.post_process:
            model.output_layer = ValueHead(args.hidden_size, device=dims.device,
                                           sequence_parallel=config.sequence_parallel)
        model.to(dims.device)
        if dtype != torch.float32:
            # Every parameter in the model dtype, as megatron's Float16Module makes it: the local spec's norms are
            # created in fp32, and a model of mixed dtypes gets two grad buffers whose distributed-optimizer
            # checkpoint (dp-reshardable) megatron-core 0.16 cannot write. Buffers (rotary inv_freq) stay fp32.
            for param in model.parameters():
                param.data = param.data.to(dtype)
        if role == "ref":
            model.requires_grad_(False)
            model.eval()
        chunks.append(model)
    return chunks


def gather_sequence(hidden: torch.Tensor) -> torch.Tensor:
    """A sequence-parallel activation [s/tp, b, ...] gathered to [s, b, ...] on every TP rank.

    The backward takes this rank's slice of the incoming gradient, which is right for what mppo puts after it
    (the value head, the log-prob kernels): each TP rank computes the same gradient there, the vocab-parallel
    kernels having all-reduced it over TP themselves."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The GPTModel inside DDP/Float16Module-style wrappers (anything with a `.module`)."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model
