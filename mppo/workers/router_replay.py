"""Rollout routing replay (R3, `actor_rollout_ref.actor.router_replay.mode=R3`): the actor's MoE layers use the
experts the rollout engine chose for each token instead of choosing their own, in the old-log-prob and the update
forwards, so that a token's log-prob under the actor comes from the same experts that generated it.

Why: the engine and the trainer compute the router logits with different kernels (and often precisions); where
two experts' scores are close, they pick different experts for the same token, and the token's log-prob then
differs by far more than rounding. That mismatch biases the importance ratios of the policy loss (veRL's, slime's
and ROLL's R3 replay the engine's routes for this).

Mechanism: megatron-core's own RouterReplay (megatron/core/transformer/moe/router_replay.py). Built with
`moe_enable_routing_replay`, every TopKRouter holds a RouterReplay; with the action REPLAY_FORWARD its top-k is the
given indices and the routing weights are the router's own scores at those experts (gathered, so the gradient
still reaches the router). Each micro-batch carries the routes by token (`routed_experts` [b, s, MoE layers, k],
compacted like input_ids by mppo.workers.batching); `replaying` hands each router of a model chunk its layer's
slice for that chunk's forward. No activation recomputation runs a router again in the backward (R3 with
megatron.recompute is refused by the config validation), so the backward needs no replay.

Tokens the engine did not run (padding, a response's last token) replay experts 0..k-1: they are after every token
whose log-prob is read (causal attention), so they change nothing that is used.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
from torch import nn

from mppo.errors import UserError
from mppo.models.builders import unwrap_model
from mppo.workers.batching import ROUTES_KEY


class ReplayError(UserError, ValueError):
    """The actor replays routes, but the batch does not carry them."""


def router_replay_overrides(mode: str, *, is_moe: bool) -> dict:
    """TransformerConfig kwargs of the actor for `router_replay.mode`."""
    if mode == "disabled":
        return {}
    assert is_moe, "mppo.config.validate refuses routing replay on a dense model (check_router_replay)"
    return {"moe_enable_routing_replay": True}


def _replaying_routers(model: nn.Module) -> list[tuple[nn.Module, int]]:
    """(router, index of its layer among the model's MoE layers) of the chunk's routers built for replay."""
    core = unwrap_model(model)
    freq = core.config.moe_layer_freq
    moe_layers = [i for i, f in enumerate(freq) if f] if isinstance(freq, list) else list(range(core.config.num_layers))
    out = []
    for layer in core.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None and getattr(router, "router_replay", None) is not None:
            out.append((router, moe_layers.index(router.layer_number - 1)))
    return out


def require_routes(model_chunks, micro_batches) -> None:
    """ReplayError when the model replays routes but a micro-batch carries none.

    Asked of the model's config (the same on every rank), before any pipeline stage starts: a PP stage without
    MoE layers would otherwise wait forever for a stage that stopped at its first router."""
    replays = any(getattr(unwrap_model(c).config, "moe_enable_routing_replay", False) for c in model_chunks)
    if replays and any(mb.get(ROUTES_KEY) is None for mb in micro_batches):
        # routing by itself would silently undo what R3 is for
        raise ReplayError("actor_rollout_ref.actor.router_replay.mode=R3 but this batch has no routed_experts: the "
                          "rollout engine did not record them (only the CPU engine does); set the mode to disabled")


@contextlib.contextmanager
def replaying(model: nn.Module, data: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within: the chunk's routers replay the micro-batch's `routed_experts` (a no-op for a model not built for
    replay; ReplayError when one is given no routes)."""
    routes = data.get(ROUTES_KEY)
    routers = _replaying_routers(model)
    if not routers:
        yield
        return
    require_routes([model], [data])
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    b, s, _, k = routes.shape
    device = data["input_ids"].device
    config = unwrap_model(model).config
    if config.sequence_parallel:  # this TP rank routes its slice of the sequence only
        from megatron.core import parallel_state as ps

        part = s // config.tensor_model_parallel_size
        start = ps.get_tensor_model_parallel_rank() * part
        routes, s = routes[:, start:start + part], part
    for router, moe_index in routers:
        # megatron routes the [s, b] tokens flattened s-major: token (column c, row r) is entry c * b + r
        target = routes[:, :, moe_index].transpose(0, 1).reshape(s * b, k).to(device=device, dtype=torch.int64)
        router.router_replay.set_target_indices(target)
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for router, _ in routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()
