"""Knobs to turn when a plan does not fit: each candidate override is planned on its own and kept if it helps.

Candidates, in the order a user would try them: the distributed optimizer, more recomputation, smaller
micro-batches, the fused log-prob kernel, offloading the reference, twice the TP, twice the PP, (for the
training phase) the smallest context parallelism at which it fits, and (for the rollout phase) a larger engine
share. Each is checked with the config validator too, so a knob that breaks
batch-size arithmetic says which other key must change.
"""
from __future__ import annotations

import copy
import math
import warnings
from typing import Any

from mppo.config import ConfigError, MppoConfig, get_key, validate
from mppo.config.validate import SHARED_LAYOUT_KEYS
from mppo.models.hf_config import HFModelArgs
from mppo.plan.memory import PlanError
from mppo.plan.planner import MEGATRON, Plan, Suggestion, plan

ACTOR, ROLLOUT, REF = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.ref"
MAX_ENGINE_FRACTION = 0.95  # highest gpu_memory_utilization proposed


def _set(cfg: MppoConfig, key: str, value: Any) -> None:
    parent, _, name = key.rpartition(".")
    setattr(get_key(cfg, parent), name, value)


def _fmt(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _candidates(cfg: MppoConfig, a: HFModelArgs, p: Plan, world: int) -> list[tuple[dict[str, Any], str]]:
    """(overrides, why) of the knobs that can lower the failing phase, most specific first."""
    trained = [r.layout for r in p.roles if r.layout.trains]
    lays = [r.layout for r in p.roles]
    out: list[tuple[dict[str, Any], str]] = []
    if any(not lay.distributed_optimizer and lay.replicas > 1 for lay in trained):
        out.append(({f"{MEGATRON[lay.role]}.use_distributed_optimizer": True for lay in trained},
                    "shard the Adam states over the DP ranks"))
    nxt = {"none": "selective", "selective": "full"}
    if any(lay.recompute in nxt for lay in trained):
        out.append(({f"{MEGATRON[lay.role]}.recompute": nxt.get(lay.recompute, "full") for lay in trained},
                    "recompute activations in the backward instead of keeping them"))
    sections = {"actor": ACTOR, "critic": "critic"}
    micro = {f"{sections[lay.role]}.ppo_micro_batch_size_per_gpu": int(lay.micro_batch) // 2
             for lay in trained if not cfg.actor_rollout_ref.actor.use_dynamic_bsz and lay.micro_batch >= 2}
    if micro:
        out.append((micro, "smaller training micro-batches"))
    fwd_keys = {"actor": f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu",
                "ref": f"{REF}.log_prob_micro_batch_size_per_gpu"}
    dynamic = cfg.actor_rollout_ref.actor.use_dynamic_bsz
    fwd = {fwd_keys[lay.role]: int(lay.forward_micro_batch) // 2 for lay in lays
           if lay.role in fwd_keys and lay.forward_micro_batch >= 2 and not dynamic}
    if fwd and p.peak_phase in ("old_log_prob", "ref"):
        out.append((fwd, "smaller log-prob micro-batches"))
    if p.logprob.impl == "naive":
        out.append(({f"{ACTOR}.logprob_impl": "fused"}, "log-probs without materialising [tokens x vocab] logits"))
    if any(lay.role == "ref" and not lay.offloaded for lay in lays):
        out.append(({f"{REF}.offload_to_cpu": True}, "keep the reference weights in host memory between uses"))
    tp, pp, vpp, cp = lays[0].tp, lays[0].pp, lays[0].vpp or 1, lays[0].cp
    if (2 * tp <= cfg.trainer.n_gpus_per_node and world % (2 * tp * pp * cp) == 0
            and a.num_query_groups % (2 * tp) == 0):
        out.append(({f"{MEGATRON[lay.role]}.tensor_model_parallel_size": 2 * tp for lay in lays},
                    "split every layer over twice as many GPUs"))
    if world % (tp * 2 * pp * cp) == 0 and a.num_layers % (2 * pp * vpp) == 0:
        out.append(({f"{MEGATRON[lay.role]}.pipeline_model_parallel_size": 2 * pp for lay in lays},
                    "split the layers over twice as many pipeline stages"))
    r = p.rollout
    if not r.fits and r.engine == "sglang":
        kv = r.sequences_per_engine * r.sequence_len * r.kv_bytes_per_token
        need = (r.weights + kv) / max(1.0, r.device_memory - r.resident)
        fraction = round(min(MAX_ENGINE_FRACTION, math.ceil(need * 100) / 100), 2)
        if fraction > r.gpu_memory_utilization:
            out.append(({f"{ROLLOUT}.gpu_memory_utilization": fraction},
                        "let the engine fill more of the GPU (its KV cache is what is left of that share)"))
        out.append(({f"{MEGATRON[lay.role]}.{key}": True for lay in lays if lay.trains
                     for key in ("param_offload", "optimizer_offload")},
                    "move the training state to host memory while the engine generates (a larger KV cache)"))
    return out


def _trial(cfg: MppoConfig, overrides: dict[str, Any]) -> MppoConfig:
    """`cfg` with `overrides`. A layout knob names the roles the run builds; one it does not build follows the
    actor's layout, as its null would on the command line (every model shares one layout: check_shared_layout)."""
    trial = copy.deepcopy(cfg)
    for key, value in overrides.items():
        _set(trial, key, value)
        section, _, name = key.rpartition(".")
        if section == f"{ACTOR}.megatron" and name in SHARED_LAYOUT_KEYS:
            for other in (f"{REF}.megatron", "critic.megatron"):
                if f"{other}.{name}" not in overrides:
                    _set(trial, f"{other}.{name}", value)
    return trial


def _context_parallel(cfg: MppoConfig, a: HFModelArgs, p: Plan, **plan_kwargs: Any
                      ) -> tuple[dict[str, Any], str] | None:
    """The smallest CP (the configured one x 2, 4, ...) at which the training phase fits: each sequence split
    over that many ranks, taken from DP. CP must leave DP whole and split the sequence into 2·CP equal chunks;
    when none fits, the largest such CP (it lowers the activations most)."""
    lays = [r.layout for r in p.roles]
    tp, pp, cp = lays[0].tp, lays[0].pp, lays[0].cp
    best = None
    factor = 2
    while p.world % (tp * pp * cp * factor) == 0:
        new = cp * factor
        factor *= 2
        if p.sequence_len % (2 * new):
            continue
        overrides = {f"{MEGATRON[lay.role]}.context_parallel_size": new for lay in lays}
        try:
            tried = plan(_trial(cfg, overrides), a, suggest=False, model_name=p.model, **plan_kwargs)
        except PlanError:
            continue
        layout = next(r.layout for r in tried.roles)
        best = (overrides, f"split each {p.sequence_len}-token sequence over {new} ranks: "
                           f"TP{layout.tp} PP{layout.pp} CP{new} DP{layout.dp}")
        if tried.fits_training:
            break
    return best


def suggestions(cfg: MppoConfig, a: HFModelArgs, p: Plan, **plan_kwargs: Any) -> list[Suggestion]:
    """Each knob tried on its own: the resulting peak, KV cache and whether the config then fits."""
    out = []
    candidates = _candidates(cfg, a, p, p.world)
    if not p.fits_training:  # the sequence's activations: context parallelism
        found = _context_parallel(cfg, a, p, **plan_kwargs)
        candidates += [found] if found else []
    for overrides, why in candidates:
        trial = _trial(cfg, overrides)
        try:
            tried = plan(trial, a, suggest=False, model_name=p.model, **plan_kwargs)
        except PlanError:
            continue
        if (tried.training_peak >= p.training_peak and tried.rollout.kv_tokens <= p.rollout.kv_tokens
                and tried.rollout.peak >= p.rollout.peak):
            continue  # does not help
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # legal-but-odd settings are not this knob's business
                validate(trial)
            problem = None
        except ConfigError as e:
            problem = str(e)
        out.append(Suggestion(tuple(f"{k}={_fmt(v)}" for k, v in overrides.items()), why, tried.training_peak,
                              tried.rollout.kv_tokens, tried.fits, problem))
    return sorted(out, key=lambda s: (not s.fits, s.problem is not None, s.training_peak))
