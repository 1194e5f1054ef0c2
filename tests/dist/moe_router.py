"""torchrun script (2 CPU ranks, gloo): megatron-core's MoE router losses as mppo switches them on
(mppo.workers.moe_losses), and routing replay (mppo.workers.router_replay), at DP2, EP2, PP2 and TP2 with sequence
parallelism, on a tiny Qwen3-MoE (4 experts, top-2, 3 MoE layers and a dense one), against HF transformers.

Replay: a batch in the workers' contract (left-padded prompts) carries random routes by column; the actor's
log-probs (mppo.workers.logprob, micro-batches compacted by mppo.workers.batching) with the routes replayed equal
HF's with its routers forced to the same experts (the routing weights: softmax over the forced experts' logits,
Qwen3-MoE's norm_topk_prob), and differ from them without replay.

Each case runs training forwards and backwards of micro-batches whose main loss is 0 x the output, so every
gradient is that of the router losses. Checked: the metrics MoELossMeter reports equal the Switch aux loss and the
z-loss written here from their definitions (mean over MoE layers and micro-batches, averaged over DP ranks, each
DP rank with its own micro-batches); the router weights' gradients equal HF autograd of
coeff x (sum over layers of those losses, averaged over micro-batches); with both coefficients 0 no metric and
zero gradients. Rank R writes out/rank{R}.json; tests/test_moe_router.py asserts on it.
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # + dist_util
from dist_util import rank_main  # noqa: E402
from models_fixtures import load_hf_model, make_hf_model  # noqa: E402
from models_parallel import micro_batches  # noqa: E402

# name -> (tp, pp, ep); megatron-core trains MoE layers under TP only with sequence parallelism: tp2sp has it
LAYOUTS = {"dp2": (1, 1, 1), "ep2": (1, 1, 2), "pp2": (1, 2, 1), "tp2sp": (2, 1, 1)}
LOSS_LAYOUTS = ("dp2", "ep2", "pp2", "tp2sp")
AUX, Z = 0.3, 0.05
COEFFS = {"aux_and_z": (AUX, Z), "aux_only": (AUX, 0.0), "off": (0.0, 0.0)}
MODEL = "qwen3_moe"


def naive_switch_aux_loss(logits: torch.Tensor, topk: int) -> torch.Tensor:
    """E * sum_i f_i * P_i over T tokens: f_i = share of the T * k top-k slots given to expert i, P_i = mean
    softmax probability of expert i (differentiable through P_i only)."""
    tokens, experts = logits.shape
    probs = torch.softmax(logits.float(), dim=-1)
    chosen = probs.topk(topk, dim=-1).indices
    loss = logits.new_zeros((), dtype=torch.float32)
    for i in range(experts):
        f_i = float((chosen == i).sum()) / (tokens * topk)
        p_i = probs[:, i].sum() / tokens
        loss = loss + f_i * p_i
    return experts * loss


def naive_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of (log sum_i exp(logit_i))^2."""
    return (torch.logsumexp(logits.float(), dim=-1) ** 2).mean()


def hf_router_losses(hf, batches, topk: int) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Per micro-batch: {0-based MoE layer: (aux loss, z-loss)} from HF's router logits (with autograd)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda _m, _i, out, index=index: captured.__setitem__(index, out[0])))
    out = []
    for mb in batches:
        captured.clear()
        hf(mb["input_ids"])
        out.append({i: (naive_switch_aux_loss(lg, topk), naive_z_loss(lg)) for i, lg in captured.items()})
    for h in hooks:
        h.remove()
    return out


def zero_loss_step(model, batch):
    """Forward whose loss is 0 x the output: the backward carries only the router losses' gradients."""
    from mppo.models.builders import unwrap_model

    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    output = model(ids, positions, None)
    if not unwrap_model(model).post_process:
        return output, None
    return output, lambda out: (out.float().sum() * 0.0, {})


def run_case(work: Path, hf, args, layout, coeffs, res: dict, key: str) -> None:
    from megatron.core import parallel_state as ps

    from mppo.config.schema import TransformerOverrides, actor_megatron_defaults
    from mppo.models.builders import build_gpt_model
    from mppo.models.weights import load_hf_weights
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.moe_losses import MoELossMeter, moe_loss_overrides
    from mppo.workers.pipeline import run_pipeline

    tp, pp, ep = layout
    dims = init_distributed(tp, pp, ep=ep)
    megatron = replace(actor_megatron_defaults(), override_transformer_config=TransformerOverrides(*coeffs))
    chunks = build_gpt_model(args, dims, role="actor", sequence_parallel=tp > 1,
                             **moe_loss_overrides(megatron, is_moe=True))
    load_hf_weights(chunks, work / MODEL, args)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_dp = [micro_batches(args.vocab_size, seed=40 + r) for r in range(dp)]
    if tp > 1:  # sequence parallelism splits each micro-batch's sequence over the TP ranks: even lengths
        per_dp = [[{"input_ids": mb["input_ids"][:, :mb["input_ids"].shape[1] // tp * tp]} for mb in mbs]
                  for mbs in per_dp]

    meter = MoELossMeter.start(chunks, "actor")
    for c in chunks:
        c.zero_grad(set_to_none=True)
    run_pipeline(chunks, per_dp[dp_rank], zero_loss_step, forward_only=False)
    metrics = meter.finish()
    res[f"{key}/metrics"] = metrics

    # references: metrics over every DP rank's micro-batches, gradients over this rank's
    aux_c, z_c = coeffs
    ref_aux, ref_z = [], []
    for r in range(dp):
        with torch.no_grad():
            losses = hf_router_losses(hf, per_dp[r], args.moe_topk)
        ref_aux.append(sum(sum(a for a, _ in mb.values()) / len(mb) for mb in losses) / len(losses))
        ref_z.append(sum(sum(z for _, z in mb.values()) / len(mb) for mb in losses) / len(losses))
    res[f"{key}/ref"] = {"actor/moe_aux_loss": float(sum(ref_aux) / dp), "actor/moe_z_loss": float(sum(ref_z) / dp)}

    hf.zero_grad(set_to_none=True)
    losses = hf_router_losses(hf, per_dp[dp_rank], args.moe_topk)
    total = sum(sum(aux_c * a + z_c * z for a, z in mb.values()) for mb in losses) / len(losses)
    if aux_c or z_c:
        total.backward()
    worst, norms = 0.0, []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            if not hasattr(layer.mlp, "router"):
                continue
            got = layer.mlp.router.weight.grad
            got = torch.zeros_like(layer.mlp.router.weight) if got is None else got.clone()
            if layer.config.sequence_parallel:  # a partial sum over this TP rank's tokens, as finalize_model_grads
                dist.all_reduce(got, group=ps.get_tensor_model_parallel_group())  # sums it
            ref = hf.model.layers[layer.layer_number - 1].mlp.gate.weight.grad
            ref = torch.zeros_like(got) if ref is None else ref
            worst = max(worst, float((got - ref).abs().max()))
            norms.append(float(ref.abs().max()))
    res[f"{key}/router_grad_diff"] = worst
    res[f"{key}/router_grad_ref_max"] = max(norms) if norms else 0.0
    res[f"{key}/router_grad_got_max"] = max(
        [float(layer.mlp.router.weight.grad.abs().max()) if layer.mlp.router.weight.grad is not None else 0.0
         for chunk in chunks for layer in chunk.decoder.layers if hasattr(layer.mlp, "router")] or [0.0])
    destroy()


def forced_hf_logprobs(hf, batch, moe_layers: tuple[int, ...], topk: int) -> torch.Tensor:
    """HF's response log-probs with each MoE layer's experts forced to batch["routed_experts"] (by column)."""
    from workers_fixtures import hf_response_logprobs

    routes = batch["routed_experts"]
    saved = {}
    for moe_index, layer_index in enumerate(moe_layers):
        gate = hf.model.layers[layer_index].mlp.gate
        saved[layer_index] = gate.forward

        def forced(hidden, gate=gate, moe_index=moe_index):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            chosen = routes[:, :, moe_index].reshape(-1, topk).long()  # HF flattens [b, s] row-major
            weights = torch.softmax(logits.float().gather(1, chosen), dim=-1)
            return logits, weights.to(logits.dtype), chosen
        gate.forward = forced
    try:
        with torch.no_grad():
            return hf_response_logprobs(hf, batch)[0]
    finally:
        for layer_index, forward in saved.items():
            hf.model.layers[layer_index].mlp.gate.forward = forward


def replay_case(work: Path, hf, args, layout, res: dict, key: str) -> None:
    from workers_fixtures import TEMPERATURE, hf_response_logprobs, make_batch

    from mppo.models.builders import build_gpt_model
    from mppo.models.weights import load_hf_weights
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.batching import validate_batch
    from mppo.workers.logprob import compute_response_outputs, make_logprob_fn
    from mppo.workers.router_replay import ReplayError, router_replay_overrides

    tp, pp, ep = layout
    dims = init_distributed(tp, pp, ep=ep)
    chunks = build_gpt_model(args, dims, role="actor", sequence_parallel=tp > 1,
                             **router_replay_overrides("R3", is_moe=True))
    load_hf_weights(chunks, work / MODEL, args)
    batch = make_batch(args.vocab_size, seed=3)
    g = torch.Generator().manual_seed(9)
    rows, cols = batch["input_ids"].shape
    layers, k = len(args.moe_layers), args.moe_topk
    batch["routed_experts"] = torch.stack([torch.randperm(args.num_experts, generator=g)[:k]
                                           for _ in range(rows * cols * layers)]).view(rows, cols, layers, k).int()
    validate_batch(batch)
    mask = batch["response_mask"].bool()
    logprob_fn = make_logprob_fn("naive")
    with torch.no_grad():
        replayed = compute_response_outputs(chunks, batch, logprob_fn, vocab_size=args.vocab_size,
                                            temperature=TEMPERATURE, micro_batch_size=3,
                                            max_token_len=None)["log_probs"]
        hf_free = hf_response_logprobs(hf, batch)[0]
        try:  # a replaying actor given no routes stops instead of routing by itself
            compute_response_outputs(chunks, {k2: v for k2, v in batch.items() if k2 != "routed_experts"},
                                     logprob_fn, vocab_size=args.vocab_size, temperature=TEMPERATURE,
                                     micro_batch_size=3, max_token_len=None)
            res[f"{key}/no_routes_error"] = "no error"
        except ReplayError as err:
            res[f"{key}/no_routes_error"] = str(err)
    forced = forced_hf_logprobs(hf, batch, args.moe_layers, k)
    res[f"{key}/replayed_vs_forced_hf"] = float((replayed - forced)[mask].abs().max())
    res[f"{key}/hf_free_vs_forced_hf"] = float((hf_free - forced)[mask].abs().max())
    destroy()


def run_all(opts, res: dict) -> None:
    from mppo.models.hf_config import read_hf_config

    work = opts.out / "work"
    if int(os.environ["RANK"]) == 0:
        make_hf_model(MODEL, work / MODEL, seed=7)
    dist.barrier()
    hf = load_hf_model(work / MODEL)
    args = read_hf_config(work / MODEL)
    for name, layout in LAYOUTS.items():
        for cname, coeffs in COEFFS.items():
            if name not in LOSS_LAYOUTS or (name != "dp2" and cname == "aux_only"):
                continue
            run_case(work, hf, args, layout, coeffs, res, f"{name}/{cname}")
        replay_case(work, hf, args, layout, res, f"{name}/replay")


def main() -> None:
    rank_main(run_all)


if __name__ == "__main__":
    main()
