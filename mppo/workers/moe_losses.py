"""MoE router losses of a trainable role: megatron-core's load-balancing aux loss and router z-loss, switched on
by `<role>.megatron.override_transformer_config.moe_aux_loss_coeff` / `moe_z_loss_coeff` (veRL's keys), and their
values as `<role>/moe_aux_loss` and `<role>/moe_z_loss`.

megatron-core adds both losses itself: in a training forward with autograd on, each router attaches
`coeff x loss` to its output (MoEAuxLossAutoScaler), so the backward of the role's loss includes their gradient,
with no change to the loss function. The schedule scales that gradient by 1 / micro-batches (mppo's run_pipeline
undoes that division for the main loss only, not for these): the gradient is that of coeff x (the losses of each
micro-batch averaged over micro-batches and DP ranks), megatron's own convention. Every token of a micro-batch
counts, padding included (no padding mask reaches the router).

    aux loss of a layer = E * sum_i f_i * P_i   (Switch Transformer), over the micro-batch's T tokens:
        f_i = (tokens routed to expert i among the top-k) / (T * k),  P_i = mean over tokens of softmax(logits)_i
    z-loss of a layer = mean over tokens of logsumexp(router logits)^2   (ST-MoE)

Each router also saves the loss value (without the coefficient) in megatron's layer-wise tracker
(`moe_utils.get_moe_layer_wise_logging_tracker`); `MoELossMeter` reads it after an update: the mean over the MoE
layers and the update's micro-batches, averaged over DP ranks. A coefficient of 0 = that loss is off and has no
metric.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mppo.config.schema import MegatronConfig
from mppo.models.builders import unwrap_model

# megatron's tracker name -> the metric suffix
TRACKED = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}


def moe_loss_overrides(megatron: MegatronConfig, *, is_moe: bool) -> dict:
    """TransformerConfig kwargs for the role's MoE losses ({} when both are off).

    megatron-core trains a MoE model under TP only with sequence parallelism; there each TP rank computes both
    losses over its slice of the tokens, which `MoELossMeter` combines again.
    """
    overrides = megatron.override_transformer_config
    aux, z = overrides.moe_aux_loss_coeff or 0.0, overrides.moe_z_loss_coeff or 0.0
    if not is_moe or (aux == 0 and z == 0):
        return {}
    return {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": aux,
            # None, not 0: megatron computes (and tracks, dividing by the coefficient) a z-loss whenever it is set
            "moe_z_loss_coeff": z if z > 0 else None}


def _routers(model_chunks: Sequence[nn.Module]) -> list[nn.Module]:
    return [layer.mlp.router for chunk in model_chunks for layer in unwrap_model(chunk).decoder.layers
            if hasattr(layer.mlp, "router")]


class MoELossMeter:
    """The MoE loss metrics of one update: `start` before its first forward, `finish` after its last (collective
    over the world when the model has MoE losses on; otherwise both do nothing)."""

    def __init__(self, model_chunks: Sequence[nn.Module], prefix: str):
        config = unwrap_model(model_chunks[0]).config
        moe = bool(config.num_moe_experts)
        self.losses_on = {"load_balancing_loss": moe and bool(config.moe_aux_loss_coeff),
                          "z_loss": moe and config.moe_z_loss_coeff is not None}
        self.on = any(self.losses_on.values())
        self.prefix, self.forwards, self.hooks = prefix, 0, []
        self.device = next(model_chunks[0].parameters()).device
        if not self.on:
            return
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.num_moe_layers = sum(config.moe_layer_freq) if isinstance(config.moe_layer_freq, list) \
            else config.num_layers
        clear_aux_losses_tracker()  # nothing of another role's update or an earlier step
        routers = _routers(model_chunks)
        if routers:  # count this rank's training forwards (micro-batches) through one router
            self.hooks.append(routers[0].register_forward_hook(self._count))

    @classmethod
    def start(cls, model_chunks: Sequence[nn.Module], prefix: str) -> "MoELossMeter":
        return cls(model_chunks, prefix)

    def _count(self, module: nn.Module, *_):
        if module.training and torch.is_grad_enabled():
            self.forwards += 1

    def finish(self) -> dict[str, float]:
        """{prefix/moe_aux_loss, prefix/moe_z_loss} of the losses that are on, the same on every rank."""
        for hook in self.hooks:
            hook.remove()
        if not self.on:
            return {}
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        out = {}
        for name, suffix in TRACKED.items():
            if not self.losses_on[name]:
                continue
            # this rank's MoE layers, summed over its micro-batches, as a mean over micro-batches (ranks of a
            # stage without MoE layers contribute 0; DP ranks may run different numbers of micro-batches)
            values = tracker[name]["values"].detach().double().sum() if name in tracker else torch.zeros((),
                                                                                                      dtype=torch.float64)
            total = (values / max(self.forwards, 1)).reshape(1).to(self.device)
            # under sequence parallelism each TP rank tracks its own tokens: its share of the Switch loss (a sum
            # over TP), the mean z-loss over them (averaged over TP)
            dist.all_reduce(total, group=ps.get_tensor_model_parallel_group())
            if name == "z_loss":
                total = total / ps.get_tensor_model_parallel_world_size()
            dist.all_reduce(total, group=ps.get_pipeline_model_parallel_group())  # the stages' layers
            dist.all_reduce(total, group=ps.get_data_parallel_group())
            out[f"{self.prefix}/{suffix}"] = float(total) / ps.get_data_parallel_world_size() / self.num_moe_layers
        clear_aux_losses_tracker()
        return out
