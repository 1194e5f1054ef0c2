"""Micro-batches through megatron's pipeline schedules, and the per-token log-prob / value computations on top.

`run_pipeline` wraps `megatron.core.pipeline_parallel.get_forward_backward_func()`: no pipelining (PP=1),
1F1B (PP>1) or interleaved 1F1B (PP>1 with virtual chunks). The caller supplies a `forward_step(model_chunk,
micro_batch) -> (output, loss_fn)`; on the last stage `loss_fn(output) -> (loss, outputs_dict)` turns the
chunk's output into a loss and the tensors to return. The wrapper gives back each micro-batch's outputs_dict,
broadcast from the last stage to every PP rank.

Batch format: every micro-batch is a dict with `input_ids` [b, s] (int64), rows RIGHT-padded (a row's real tokens
start at column 0). megatron's rotary embedding always uses positions 0..s-1 and the attention is causal only,
so padding after the real tokens changes nothing before it; outputs at padded positions are meaningless and
the caller masks them. Micro-batches may differ in b and s (shapes are sent ahead of activations), except
with the interleaved schedule, which needs one shape: `pad_micro_batches` (compute_token_logprobs and
compute_values pad and trim by themselves).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.models.builders import unwrap_model
from mppo.models.vocab import mask_padded_logits, valid_vocab_size_per_rank
from mppo.parallel import collective_device
from mppo.workers.router_replay import require_routes

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
                         f"{sorted(shapes)}; pad them with mppo.workers.pipeline.pad_micro_batches")

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


def pad_micro_batches(micro_batches: Sequence[Batch]) -> list[dict[str, torch.Tensor]]:
    """Right-pad every micro-batch to the largest [b, s] with zeros: dim 0 of every tensor (rows), and dim 1 of
    tensors whose dim 1 is the micro-batch's sequence length. Zero-padded masks keep padding out of losses;
    the caller slices outputs back to each micro-batch's own [b, s]."""
    rows = max(mb["input_ids"].shape[0] for mb in micro_batches)
    cols = max(mb["input_ids"].shape[1] for mb in micro_batches)
    padded = []
    for mb in micro_batches:
        b, s = mb["input_ids"].shape
        out = {}
        for key, t in mb.items():
            pad = [0, 0] * t.dim()
            pad[-1] = rows - b  # F.pad lists dims last-first: the final pair is dim 0
            if t.dim() >= 2 and t.shape[1] == s:
                pad[-3] = cols - s
            out[key] = torch.nn.functional.pad(t, pad)
        padded.append(out)
    return padded


def _run_trimmed(model_chunks, micro_batches, step) -> list[dict[str, torch.Tensor]]:
    """run_pipeline for [b, s]-shaped outputs, padding/trimming around schedules that need one shape."""
    if not needs_uniform_shapes(model_chunks):
        return run_pipeline(model_chunks, micro_batches, step, forward_only=True)
    outs = run_pipeline(model_chunks, pad_micro_batches(micro_batches), step, forward_only=True)
    trimmed = []
    for mb, out in zip(micro_batches, outs):
        b, s = mb["input_ids"].shape
        trimmed.append({k: v[:b, :s] for k, v in out.items()})
    return trimmed


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
    """Make a last-stage GPTModel return its final (normed) hidden states [s, b, h] instead of logits.

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


def _stage_output(model: nn.Module, batch: Batch, *, hidden_only: bool) -> torch.Tensor:
    input_ids = batch["input_ids"]
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    ctx = _final_hidden_states(model) if hidden_only else contextlib.nullcontext()
    with ctx:
        return model(input_ids, position_ids, None)


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """labels[:, t] = input_ids[:, t + 1]; the last column (no next token) is 0 and must be masked by the caller."""
    labels = torch.zeros_like(input_ids)
    labels[:, :-1] = input_ids[:, 1:]
    return labels


# ---------------------------------------------------------------------------------------------- log-probs
class LogProbFn(Protocol):
    """hidden [N, h], this rank's output weight shard [V_local, h], labels [N] -> (log_probs [N], entropy [N]).

    The signature of `mppo.kernels.fused_linear_logprob_entropy`; `vocab_parallel_logprob_entropy` is the
    megatron-primitive reference. `hidden` is replicated over TP (the function itself all-reduces its
    gradient), `labels` are global token ids, and `valid_vocab_size` is the real (unpadded) GLOBAL vocabulary:
    the padded rows beyond it are masked out of the softmax.
    """

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float,
                 tp_group: Any, valid_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def vocab_parallel_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                                   temperature: float, tp_group: Any = None,
                                   valid_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(label) and the entropy of softmax(hidden @ weight.T / temperature) over the TP-split vocabulary.

    Differentiable. Uses megatron's `vocab_parallel_cross_entropy` (which works on megatron's TP group) and
    its autograd-aware TP collectives, and materialises this rank's [N, V_local] logits in fp32. With bf16
    weights the product is taken in fp32 too (as the fused kernel does): a bf16 matmul would round every logit to
    8 significant bits before the softmax.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    group = ps.get_tensor_model_parallel_group()
    if tp_group is not None and tp_group is not group:
        raise ValueError("vocab_parallel_logprob_entropy runs on megatron's tensor-parallel group only")
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    local_valid = valid_vocab_size_per_rank(valid_vocab_size, weight.shape[0] * tp, tp_rank, tp)
    # Each rank sees only its vocab slice: the gradient w.r.t. the replicated hidden states is a sum over ranks.
    hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    logits = torch.matmul(hidden.float(), weight.float().t()) / temperature
    logits = mask_padded_logits(logits, local_valid)
    # vocab_parallel_cross_entropy overwrites fp32 logits in place: give it its own copy.
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)

    local_max = logits.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max
    exp = shifted.exp()
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    sum_exp_z = tensor_parallel.reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    entropy = sum_exp.log() - sum_exp_z / sum_exp
    return log_probs, entropy


def _output_weight(model: nn.Module) -> torch.Tensor:
    core = unwrap_model(model)
    if core.share_embeddings_and_output_weights:
        return core.shared_embedding_or_output_weight()
    return core.output_layer.weight


def logprob_forward_step(*, vocab_size: int, temperature: float = 1.0,
                         logprob_fn: LogProbFn = vocab_parallel_logprob_entropy) -> ForwardStep:
    """A `forward_step` whose last-stage outputs are {"log_probs", "entropy"} [b, s] in fp32 for next tokens.

    Column t holds log p(input_ids[:, t+1] | input_ids[:, :t+1]); the last column is 0. `vocab_size` is the
    real (unpadded) vocabulary. The loss is the sum of log-probs (a placeholder; the actor supplies its own).
    """
    from megatron.core import parallel_state as ps

    def forward_step(model: nn.Module, batch: Batch):
        core = unwrap_model(model)
        output = _stage_output(model, batch, hidden_only=core.post_process)
        if not core.post_process:
            return output, None

        def loss_fn(hidden: torch.Tensor):
            b, s = batch["input_ids"].shape
            labels = next_token_labels(batch["input_ids"]).reshape(-1)
            log_probs, entropy = logprob_fn(hidden.transpose(0, 1).reshape(b * s, -1), _output_weight(model),
                                            labels, temperature=temperature,
                                            tp_group=ps.get_tensor_model_parallel_group(),
                                            valid_vocab_size=vocab_size)
            last = torch.ones(b, s, device=hidden.device)
            last[:, -1] = 0
            log_probs, entropy = log_probs.reshape(b, s) * last, entropy.reshape(b, s) * last
            return log_probs.sum(), {"log_probs": log_probs, "entropy": entropy}

        return output, loss_fn

    return forward_step


def compute_token_logprobs(model_chunks: Sequence[nn.Module], micro_batches: Sequence[Batch], *, vocab_size: int,
                           temperature: float = 1.0,
                           logprob_fn: LogProbFn = vocab_parallel_logprob_entropy) -> list[dict[str, torch.Tensor]]:
    """Forward-only log-probs and entropy of the next tokens, per micro-batch, on every PP rank.

    Each output is [b, s] fp32 like the micro-batch; column t is about token t+1, the last column is 0.
    """
    step = logprob_forward_step(vocab_size=vocab_size, temperature=temperature, logprob_fn=logprob_fn)
    outs = _run_trimmed(model_chunks, micro_batches, step)
    for out in outs:  # a padded micro-batch had a "next token" after its last column: drop it again
        for value in out.values():
            value[:, -1] = 0
    return outs


# ---------------------------------------------------------------------------------------------- values
def value_forward_step() -> ForwardStep:
    """A `forward_step` for the critic: last-stage outputs {"values"} [b, s] in fp32 (loss: their sum)."""

    def forward_step(model: nn.Module, batch: Batch):
        output = _stage_output(model, batch, hidden_only=False)
        if not unwrap_model(model).post_process:
            return output, None

        def loss_fn(values: torch.Tensor):  # [b, s, 1] from the value head
            values = values.squeeze(-1).float()
            return values.sum(), {"values": values}

        return output, loss_fn

    return forward_step


def compute_values(model_chunks: Sequence[nn.Module], micro_batches: Sequence[Batch]) -> list[dict[str, torch.Tensor]]:
    """Forward-only critic values per token, per micro-batch, on every PP rank."""
    return _run_trimmed(model_chunks, micro_batches, value_forward_step())


__all__ = ["Batch", "ForwardStep", "LogProbFn", "LossFn", "broadcast_from_last_stage", "compute_token_logprobs",
           "compute_values", "logprob_forward_step", "needs_uniform_shapes", "next_token_labels",
           "pad_micro_batches", "run_pipeline", "value_forward_step", "vocab_parallel_logprob_entropy"]
