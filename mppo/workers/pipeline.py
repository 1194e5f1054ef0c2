"""Micro-batches through megatron's pipeline schedules: the one forward path of the actor, critic and reference.

`run_pipeline` wraps `megatron.core.pipeline_parallel.get_forward_backward_func()`: no pipelining (PP=1),
1F1B (PP>1) or interleaved 1F1B (PP>1 with virtual chunks). The caller supplies a `forward_step(model_chunk,
micro_batch) -> (output, loss_fn)`; on the last stage `loss_fn(output) -> (loss, outputs_dict)` turns the
chunk's output into a loss and the tensors to return. The wrapper gives back each micro-batch's outputs_dict,
broadcast from the last stage to every PP rank.

The workers' path on top: `micro_batches_for` cuts a batch (mppo.workers.batching's data contract) into
compacted micro-batches, `pipeline_inputs` pads them where the schedule needs one shape (interleaved PP),
`response_forward_step` runs each chunk and hands the last stage's output (logits / values, or the final hidden
states for a fused log-prob kernel) to the caller's loss function, and `run_forward_only` reassembles [b, T]
outputs in batch row order.

Micro-batch format: `input_ids` [b, s] (int64), rows RIGHT-padded (a row's real tokens start at column 0).
megatron's rotary embedding always uses positions 0..s-1 and the attention is causal only, so padding after the
real tokens changes nothing before it; outputs at padded positions are meaningless and the caller masks them.

Under context parallelism (CP > 1) each CP rank runs its 2 of the sequence's 2·CP load-balanced chunks
(`mppo.parallel.context_parallel`): `stage_forward` splits `input_ids`, and the last stage hands the loss function
`cp_local_view(micro_batch)`, whose `response_index` / `response_valid` point at this rank's positions only (the
labels stay those of the full sequence, shifted before the split). Per-token outputs (log-probs, entropy, values)
are computed on the rank's own tokens into [b, T] grids that are 0 elsewhere and summed over CP
(`sum_over_cp`, identity backward), so every loss and metric after them sees the whole sequence, unchanged. The
gradient then needs no rescaling: megatron's schedule multiplies each loss by CP and DDP averages over DP x CP.
Micro-batches may differ in b and s (shapes are sent ahead of activations), except with the interleaved
schedule, which needs one shape (`pipeline_inputs` pads them).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.builders import gather_sequence, unwrap_model
from mppo.parallel import collective_device
from mppo.parallel.context_parallel import cp_positions
from mppo.workers.batching import TOKEN_COUNTER, MicroBatch, make_micro_batches, pad_to_uniform, scatter_rows
from mppo.workers.router_replay import replaying, require_routes

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
# (model chunk, micro-batch) -> (chunk output, loss_fn); loss_fn may be None on stages other than the last.
ForwardStep = Callable[[nn.Module, Batch], tuple[torch.Tensor, "LossFn | None"]]


def run_pipeline(model_chunks: Sequence[nn.Module], micro_batches: Sequence[Batch], forward_step: ForwardStep,
                 *, forward_only: bool = True, broadcast_outputs: bool = True) -> list[dict[str, torch.Tensor]]:
    """Run all micro-batches through the model chunks with megatron's schedule; return per-micro-batch outputs.

    The loss a `loss_fn` returns is back-propagated exactly as returned (megatron divides it by the number of
    micro-batches in place; the wrapper multiplies that back), so normalise it yourself, e.g. by the global
    token count. Outputs are detached. With `forward_only` nothing is recorded for autograd. With
    `broadcast_outputs=False` only the last PP stage gets the outputs (others get an empty list).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("run_pipeline needs at least one micro-batch")
    n = len(micro_batches)
    pp = ps.get_pipeline_model_parallel_world_size()
    if len(model_chunks) > 1 and n % pp != 0:
        raise ValueError(f"the interleaved pipeline schedule (vpp={len(model_chunks)}) needs a number of "
                         f"micro-batches divisible by pp={pp}, got {n}; split or merge micro-batches")
    require_routes(model_chunks, micro_batches)  # on every rank before the schedule, not in one stage's forward
    shapes = {tuple(mb["input_ids"].shape) for mb in micro_batches}
    if needs_uniform_shapes(model_chunks) and len(shapes) > 1:
        raise ValueError(f"this pipeline (interleaved, pp={pp}) needs micro-batches of one shape, got "
                         f"{sorted(shapes)}; pass them through mppo.workers.pipeline.pipeline_inputs, which pads them "
                         "(batching.pad_to_uniform)")

    def megatron_step(data_iterator: Iterator[Batch], model: nn.Module):
        output, loss_fn = forward_step(model, next(data_iterator))
        if loss_fn is None:  # not the last stage: megatron never asks for a loss here
            return output, None

        def scaled_loss(output_tensor: torch.Tensor):
            loss, outputs = loss_fn(output_tensor)
            # The schedule divides by n in place: hand it a fresh tensor that undoes the division.
            return loss * n, {k: v.detach() for k, v in outputs.items()}

        return output, scaled_loss

    data = [iter(micro_batches) for _ in model_chunks]
    for chunk in model_chunks:  # as veRL: dropout (the HF config's) in the update, none in log-prob/value passes
        chunk.train(not forward_only)
    grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with grad_ctx:
        outputs = get_forward_backward_func()(
            forward_step_func=megatron_step,
            data_iterator=data if len(model_chunks) > 1 else data[0],
            model=list(model_chunks) if len(model_chunks) > 1 else model_chunks[0],
            num_microbatches=n,
            seq_length=max(mb["input_ids"].shape[1] for mb in micro_batches),
            micro_batch_size=max(mb["input_ids"].shape[0] for mb in micro_batches),
            forward_only=forward_only)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        outputs = []
    if broadcast_outputs and pp > 1:
        outputs = broadcast_from_last_stage(outputs)
    return list(outputs)


def needs_uniform_shapes(model_chunks: Sequence[nn.Module]) -> bool:
    """True when the schedule cannot take micro-batches of different shapes (PP > 1 without shape exchange)."""
    config = unwrap_model(model_chunks[0]).config
    return config.pipeline_model_parallel_size > 1 and not config.variable_seq_lengths


def broadcast_from_last_stage(outputs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Send the last PP stage's list of tensor dicts to every rank of its PP group (collective over PP)."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    src = dist.get_global_rank(group, ps.get_pipeline_model_parallel_world_size() - 1)
    is_src = ps.is_pipeline_last_stage(ignore_virtual=True)
    meta: list[Any] = [[{k: (tuple(v.shape), v.dtype) for k, v in d.items()} for d in outputs] if is_src else None]
    dist.broadcast_object_list(meta, src=src, group=group)
    device = collective_device(group)
    result = []
    for i, entry in enumerate(meta[0]):
        d = {}
        for key, (shape, dtype) in entry.items():
            t = outputs[i][key].contiguous() if is_src else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src, group=group)
            d[key] = t
        result.append(d)
    return result


@contextlib.contextmanager
def _final_hidden_states(model: nn.Module):
    """Make a last-stage GPTModel return its final (normed) hidden states [s, b, h] instead of its output layer's.

    GPTModel._postprocess returns the decoder output when `post_process` is False; the decoder's own final
    norm was built at construction and still runs. This skips the output layer so a fused kernel can use it.
    """
    core = unwrap_model(model)
    saved = core.post_process
    core.post_process = False
    try:
        yield
    finally:
        core.post_process = saved
    _wait_param_sync(model, core.output_layer)


def _wait_param_sync(model: nn.Module, module: nn.Module) -> None:
    """What DDP's forward pre-hook does for a module that runs: with overlap_param_gather, wait for the all-gather
    of the module's parameters. The output layer does not run on the fused path (the kernel reads its weight), so
    without this its bucket's all-gather would still be in flight when the kernel reads the weight (and the next
    step's all-gather would find it outstanding)."""
    if getattr(model, "use_forward_hook", False):
        model._make_forward_pre_hook()(module)


def stage_forward(model: nn.Module, input_ids: torch.Tensor, *, hidden_only: bool) -> torch.Tensor:
    """One chunk's forward on a right-padded micro-batch (positions 0..s-1, causal attention); under CP on this
    CP rank's positions of it (megatron's rotary embedding takes the same positions by itself)."""
    config = unwrap_model(model).config
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    if config.context_parallel_size > 1:
        from megatron.core import parallel_state as ps

        positions = cp_positions(input_ids.shape[1], config.context_parallel_size, ps.get_context_parallel_rank(),
                                 device=input_ids.device)
        input_ids = input_ids.index_select(1, positions)
    position_ids = positions.expand_as(input_ids)
    if not hidden_only:
        return model(input_ids, position_ids, None)
    with _final_hidden_states(model):
        hidden = model(input_ids, position_ids, None)
    # under sequence parallelism the decoder's output is this TP rank's slice of the sequence
    return gather_sequence(hidden) if config.sequence_parallel else hidden


def cp_local_view(data: Batch, cp: int, cp_rank: int) -> dict[str, torch.Tensor]:
    """A micro-batch's data as this CP rank's loss function reads it: `response_index` in local positions and
    `response_valid` only where the predicting position is this rank's; every other entry (labels, masks, update
    inputs) as it is."""
    seq_len = data["input_ids"].shape[1]
    chunk = seq_len // (2 * cp)
    index = data["response_index"]
    natural_chunk = index // chunk
    first, second = natural_chunk == cp_rank, natural_chunk == 2 * cp - 1 - cp_rank
    local = torch.where(second, index % chunk + chunk, index % chunk)
    view = dict(data)
    view["response_valid"] = data["response_valid"] & (first | second)
    view["response_index"] = torch.where(first | second, local, torch.zeros_like(local))
    return view


def response_forward_step(make_loss_fn: Callable[[nn.Module, Batch], LossFn], *, hidden_only: bool) -> ForwardStep:
    """A run_pipeline forward step: every stage runs its chunk; the last stage hands its output (its final hidden
    states with `hidden_only`) to the `make_loss_fn(model, micro_batch)` closure, which reads the response
    positions with `mppo.workers.base.response_rows` (under CP: of `cp_local_view(micro_batch)`)."""

    def forward_step(model: nn.Module, batch: Batch):
        core = unwrap_model(model)
        last = core.post_process
        with replaying(model, batch):  # the rollout's MoE routes, for an actor built to replay them
            output = stage_forward(model, batch["input_ids"], hidden_only=hidden_only and last)
        if not last:
            return output, None
        cp = core.config.context_parallel_size
        if cp > 1:
            from megatron.core import parallel_state as ps

            batch = cp_local_view(batch, cp, ps.get_context_parallel_rank())
        return output, make_loss_fn(model, batch)

    return forward_step


def micro_batches_for(batch: Batch, rows: torch.Tensor, model_chunks: Sequence[nn.Module], *,
                      micro_batch_size: int | None, max_token_len: int | None) -> list[MicroBatch]:
    """Micro-batches of `rows`, a multiple of PP of them for the interleaved schedule, each as long as a multiple
    of `sequence_multiple` of the model."""
    vpp = len(model_chunks) > 1
    config = unwrap_model(model_chunks[0]).config
    return make_micro_batches(batch, rows, micro_batch_size=micro_batch_size, max_token_len=max_token_len,
                              multiple_of=config.pipeline_model_parallel_size if vpp else 1,
                              length_multiple=sequence_multiple(config))


def sequence_multiple(config) -> int:
    """What a micro-batch's length must be a multiple of: 2·CP under context parallelism (2·CP equal chunks), times
    TP under sequence parallelism (each TP rank holds s / (CP·TP) positions). The micro-batches are right-padded up
    to it: padding after a row's tokens changes nothing before it (causal attention), and lengths vary from batch
    to batch, so refusing them is no option."""
    cp = config.context_parallel_size
    return (2 * cp if cp > 1 else 1) * (config.tensor_model_parallel_size if config.sequence_parallel else 1)


def pipeline_inputs(model_chunks: Sequence[nn.Module], micro_batches: Sequence[MicroBatch], *,
                    phase: str) -> list[Batch]:
    """Micro-batch data as the schedule takes it (one shape for the interleaved schedule); their real and
    processed tokens are added to TOKEN_COUNTER under `phase`."""
    if needs_uniform_shapes(model_chunks):
        inputs = pad_to_uniform(micro_batches)
    else:
        inputs = [mb.data for mb in micro_batches]
    for mb, data in zip(micro_batches, inputs):
        TOKEN_COUNTER.add(phase, mb.real_tokens, data["input_ids"].numel())
    return inputs


def run_forward_only(model_chunks: Sequence[nn.Module], micro_batches: Sequence[MicroBatch], step: ForwardStep,
                     num_rows: int, *, phase: str) -> dict[str, torch.Tensor]:
    """Forward-only pipeline over micro-batches; every [b, T, ...] output reassembled in batch row order on every
    rank. `phase` names it in TOKEN_COUNTER."""
    outs = run_pipeline(model_chunks, pipeline_inputs(model_chunks, micro_batches, phase=phase), step,
                        forward_only=True)
    keys = outs[0].keys()
    return {k: scatter_rows([(mb.rows, o[k][:len(mb.rows)]) for mb, o in zip(micro_batches, outs)], num_rows)
            for k in keys}
