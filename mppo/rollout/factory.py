"""The one place that decides who owns a rollout engine, builds it, and drives it: `build_rollout` -> `Rollout`.

Rollout groups. The world is cut into groups of `rollout.tensor_model_parallel_size` consecutive ranks of one node
(torchrun numbers a node's ranks consecutively, so these are consecutive local ranks; `base_gpu_id` = the group's
first local rank). Each group runs one engine of that TP size, whatever the trainer's TP/PP/DP: the CPU engine
has TP 1, so there every rank owns one; SGLang's engine is driven by the group's first rank (see
mppo.rollout.sglang_engine). Every rank gets a `Rollout` with its engine handle and its group.

Generation. `Rollout.generate(global prompts, sampling, step)` cuts the GLOBAL prompt list into one contiguous share
per group (in group order), runs each group's engine on its share, and gathers every response on every rank
(prompt-major, in global order); the trainer keeps its DP rows. Prompts keep their global index
(`prompt_offsets`), which seeds each sample, so with an engine that honours per-sample seeds (the CPU engine;
SGLang on GPU, with deterministic inference) any split over groups gives the same rollouts.
With `rollout.multi_turn` the trainer passes an `AgentLoop` (mppo.rollout.agent_loop): each group runs the agent
loop on its share over its engine (tools on the group's first rank, their messages shared with the group), and the
responses carry their loss masks (0 on tool turns) and tool-call counts through the gather.

Weights. `Rollout.sync_weights` is collective over every rank: the exporter (mppo.models.weight_export) reshards
the actor from its TP x PP x DP layout to full HF tensors for every rank of every rollout group (each
model-parallel group serves its own ranks), and each engine loads them.

Memory choreography of one generation phase (veRL/slime's, for co-located engines on GPUs):

    training ... engine weights + KV cache released (rollout.free_cache_engine)
    sync_weights:  1. engine resumes its weight memory       (SGLang resume_memory_occupation(["weights"]))
                   2. push the actor's weights                (begin_weight_update .. end_weight_update, flush_cache)
                   3. offload trainer state where configured  (<role>.megatron.param_offload / optimizer_offload:
                                                               params + grad buffers / optimizer states to host)
                   4. engine resumes its KV cache             (resume_memory_occupation(["kv_cache", "cuda_graph"]))
    generate:      5. generate
    release:       6. engine frees weights, KV cache, CUDA graphs  (flush_cache until the scheduler is idle,
                                                                    release_memory_occupation)
                   7. bring the trainer state back                  (before the log-prob passes and updates)

On the CPU neither half frees anything: SGLang's release/resume need torch_memory_saver, a CUDA library
(mppo.rollout.sglang_cpu), the CPU engine's KV cache lives only inside generate(), and the trainer state already
lives in host memory, so step 3/7 is a no-op there (mppo.workers.offload). The calls and their order are the
same on both devices; tests/test_trainer_sglang.py records them around a real run.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from mppo.config import MppoConfig
from mppo.config.lora import adapter_sync
from mppo.models.hf_config import HFModelArgs
from mppo.rollout.agent_loop import AgentLoop, ToolRunner
from mppo.rollout.base import RolloutEngine, RolloutResponse, SamplingParams
from mppo.rollout.partial import WeightSwitch, generate_partial
from mppo.rollout.seeding import stable_hash63
from mppo.rollout.tools import ToolCall
from mppo.rollout.weight_sync import SyncStats, push_actor_adapters, push_actor_weights

log = logging.getLogger("mppo")


# ---------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class RolloutLayout:
    """The rollout groups of a launch and this rank's place in them."""

    groups: tuple[tuple[int, ...], ...]  # global ranks of each group, in group order
    group_index: int  # this rank's group
    rank: int  # this rank (global)
    base_gpu_id: int  # local rank (GPU index on its node) of this group's first rank

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.groups[self.group_index]

    @property
    def engine_tp(self) -> int:
        return len(self.ranks)

    @property
    def is_driver(self) -> bool:
        """This rank is its group's first rank (it drives an SGLang engine and contributes the group's rows)."""
        return self.rank == self.ranks[0]

    @property
    def destinations(self) -> list[int]:
        """Every rank of every rollout group: each one receives full HF weights (exporter destinations)."""
        return sorted(r for group in self.groups for r in group)

    def share(self, num_prompts: int, group_index: int | None = None) -> range:
        """The contiguous range of global prompt positions a group generates (the first groups take one more
        when the prompts do not divide evenly)."""
        g = self.group_index if group_index is None else group_index
        base, extra = divmod(num_prompts, len(self.groups))
        start = g * base + min(g, extra)
        return range(start, start + base + (1 if g < extra else 0))


def rollout_layout(engine_tp: int, *, rank: int, world: int, local_rank: int, local_world: int) -> RolloutLayout:
    """Groups of `engine_tp` consecutive ranks, never across a node (`local_world` ranks per node)."""
    if engine_tp < 1 or local_world % engine_tp or world % local_world:  # mppo.preflight checks the launch's
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size = {engine_tp}: an engine's ranks "
                          f"must lie on one node, but it does not divide the {local_world} ranks per node (world "
                          f"{world}); use a divisor of {local_world}")
    groups = tuple(tuple(range(start, start + engine_tp)) for start in range(0, world, engine_tp))
    index = rank // engine_tp
    return RolloutLayout(groups=groups, group_index=index, rank=rank,
                         base_gpu_id=local_rank - (rank - groups[index][0]))


def launch_layout(engine_tp: int, *, local_world: int | None = None) -> RolloutLayout:
    """The layout of this launch (torch.distributed initialised, or a lone process). `local_world`: the ranks per
    node of the default group's world (None: torchrun's LOCAL_WORLD_SIZE; the engine ranks of a separate placement
    pass theirs, mppo.parallel.placement)."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rollout_layout(engine_tp, rank=rank, world=world, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                          local_world=local_world)


# ---------------------------------------------------------------------------------------------------- engines
@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine builder needs."""

    cfg: MppoConfig
    layout: RolloutLayout
    tp_group: Any | None  # gloo group of this rollout group's ranks (None for a group of one)
    device: torch.device  # the trainer's device (cpu: SGLang's CPU tier)
    dtype: torch.dtype  # the actor's parameter dtype: the engine computes in it
    log_dir: Path  # where an engine may write its own logs


def _cpu_engine(spec: EngineSpec) -> RolloutEngine:
    from mppo.models.hf_config import load_transformers_config
    from mppo.rollout.cpu_engine import CPURolloutEngine

    model = spec.cfg.actor_rollout_ref.model
    return CPURolloutEngine(load_transformers_config(model.path, model.trust_remote_code),
                            record_routed_experts=spec.cfg.actor_rollout_ref.actor.router_replay.mode == "R3",
                            trust_remote_code=model.trust_remote_code)


def _sglang_engine(spec: EngineSpec) -> RolloutEngine:
    from mppo.rollout.sglang_engine import SGLangRolloutEngine

    cfg, layout = spec.cfg, spec.layout
    rollout = cfg.actor_rollout_ref.rollout
    on_cpu = spec.device.type == "cpu"
    first, last = layout.ranks[0], layout.ranks[-1]
    name = f"rollout group {layout.group_index} (rank {first})" if first == last else \
        f"rollout group {layout.group_index} (ranks {first}-{last})"
    max_total_tokens = base_gpu_id = None
    if on_cpu:
        # The KV pool is host memory that SGLang would size from gpu_memory_utilization of ALL of it: cap it at
        # what a few full-length sequences need (a smaller pool only queues requests, it changes no result).
        max_total_tokens = max(4096, 8 * (cfg.data.max_prompt_length + cfg.data.max_response_length))
        # SGLang's "GPU id" on the CPU is the NUMA node its threads bind to: node 0 for every engine
        base_gpu_id = 0
    return SGLangRolloutEngine(
        cfg.actor_rollout_ref.model.path, gpu_memory_utilization=rollout.gpu_memory_utilization,
        tp_group=spec.tp_group, dtype=_SGLANG_DTYPES[spec.dtype],
        base_gpu_id=layout.base_gpu_id if base_gpu_id is None else base_gpu_id,
        seed=engine_seed(cfg.trainer.seed, layout.group_index), on_cpu=on_cpu, max_total_tokens=max_total_tokens,
        log_path=spec.log_dir / f"sglang_group{layout.group_index}.log", name=name,
        return_routed_experts=cfg.actor_rollout_ref.actor.router_replay.mode == "R3",
        trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code, lora=_engine_lora(cfg))


def _engine_lora(cfg: MppoConfig) -> dict[str, Any] | None:
    """What SGLang's LoRA support needs for adapter-only sync (lora.merge=false); None: merged weights."""
    from mppo.config.lora import lora_projections

    if not adapter_sync(cfg):
        return None
    lora = cfg.actor_rollout_ref.model.lora
    return {"rank": lora.rank, "target_modules": list(lora_projections(lora.target_modules, lora.exclude_modules))}


def engine_seed(run_seed: int, group_index: int) -> int:
    """SGLang's random_seed for one group's engine: distinct per group (an engine that samples from its own RNG,
    as SGLang on the CPU does, must not draw the same numbers as its neighbours), < 2**31 (numpy's limit)."""
    return stable_hash63(run_seed, group_index) % (1 << 31)


_SGLANG_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# rollout.name -> builder, called on every rank of a rollout group (collectively for TP > 1).
ENGINE_BUILDERS: dict[str, Callable[[EngineSpec], RolloutEngine]] = {"cpu": _cpu_engine, "sglang": _sglang_engine}


# ---------------------------------------------------------------------------------------------------- rollout
class TrainerState(Protocol):
    """Trainer memory that steps 3 and 7 of the choreography move out of the way (mppo.workers.offload)."""

    def offload(self) -> None: ...

    def reload(self) -> None: ...


class Rollout:
    """This rank's view of the launch's rollout: its engine, its group, and the collective calls the trainer makes
    (`sync_weights`, `generate`, `release`; each on every rank). See the module docstring for the sequence."""

    def __init__(self, name: str, engine: RolloutEngine, layout: RolloutLayout, *, free_cache_engine: bool,
                 object_group: Any | None, group_comm: Any | None = None, adapter_sync: bool = False) -> None:
        self.name, self.engine, self.layout = name, engine, layout
        self.adapter_sync = adapter_sync  # LoRA, lora.merge=false: the base once, then the adapters only
        self.free_cache_engine = free_cache_engine
        self._object_group = object_group  # gloo group of every rank, for gathering responses (None: world of 1)
        self._group_comm = group_comm  # gloo group of this rollout group's ranks (None: a group of one)
        self._offloaded: TrainerState | None = None
        self.version = 0  # the policy version of the weights last synced

    def sync_weights(self, model_chunks: Sequence[nn.Module], hf_args: HFModelArgs, *, bucket_bytes: int,
                     trainer_state: TrainerState | None = None, version: int = 0) -> SyncStats:
        """Steps 1-4: the actor's weights into every engine, then `trainer_state` offloaded (reloaded by
        `release`), then the KV cache back. Collective over every rank. `version`: the policy version the weights
        are (the responses generated on them carry it)."""
        if self._offloaded is not None:
            raise RuntimeError("sync_weights() twice without release(): the trainer state is still offloaded")
        push = push_actor_adapters if self.adapter_sync else push_actor_weights
        stats = push(self.engine, model_chunks, hf_args, bucket_bytes, destinations=self.layout.destinations)
        self.version = version
        if trainer_state is not None:
            trainer_state.offload()
            self._offloaded = trainer_state
        self.engine.resume()
        return stats

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, *, step: int,
                 first_index: int = 0, agent: AgentLoop | None = None,
                 partial: WeightSwitch | None = None) -> list[RolloutResponse]:
        """Step 5: every response to the GLOBAL `prompts` (prompt i has global index first_index + i), on every
        rank, prompt-major in global order. Each group generates its share (module docstring); with `agent`
        (rollout.multi_turn) each group runs the agent loop on its share, over its engine. `partial` (partial
        rollouts, the engine ranks of the separate placement): new weights interrupt the generation, which goes
        on on them (mppo.rollout.partial); each response then carries its tokens' versions."""
        share = self.layout.share(len(prompts))
        mine: list[Any] = []
        if len(share):
            own = [list(prompts[i]) for i in share]
            offsets = [first_index + i for i in share]
            if partial is not None:
                mine = generate_partial(self.engine, own, sampling, step=step, prompt_offsets=offsets,
                                        switch=partial)
            elif agent is None:
                mine = self.engine.generate(own, sampling, step=step, prompt_offsets=offsets)
            else:
                mine = agent.generate(self.engine, own, sampling, step=step, prompt_offsets=offsets,
                                      run_tools=self._group_tools(agent))
        return stamp_version(self._gather(mine if self.layout.is_driver else []), self.version)

    def _group_tools(self, agent: AgentLoop) -> ToolRunner:
        """The agent's tools run on the group's first rank, their messages shared with the group's other ranks:
        a timeout on one rank only must not make the ranks of one SGLang engine continue different conversations."""
        local = agent.local_tools()
        if self._group_comm is None:
            return local

        def run(calls: list[ToolCall]) -> list[str]:
            box = [local(calls) if self.layout.is_driver else None]
            dist.broadcast_object_list(box, src=self.layout.ranks[0], group=self._group_comm)
            return box[0]
        return run

    def release(self) -> None:
        """Steps 6-7: free the engines' memory (unless rollout.free_cache_engine is false), then reload what
        `sync_weights` offloaded. Collective over every rank."""
        if self.free_cache_engine:
            self.engine.release()
        state, self._offloaded = self._offloaded, None
        if state is not None:
            state.reload()

    def shutdown(self) -> None:
        """Stop the engines (their processes, for SGLang). Collective over every rank."""
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _gather(self, mine: list[RolloutResponse]) -> list[RolloutResponse]:
        if self._object_group is None:
            return mine
        parts: list[Any] = [None] * dist.get_world_size(self._object_group)
        dist.all_gather_object(parts, pack_responses(mine), group=self._object_group)
        return [resp for part in parts for resp in unpack_responses(part)]


def pack_responses(responses: list[RolloutResponse]) -> dict[str, torch.Tensor]:
    """Responses as a few flat tensors (they pickle as raw bytes, unlike lists of Python numbers), with what they
    carry beyond tokens and log-probs: routed experts, multi-turn loss masks and tool-call counts, partial
    rollouts' token versions (a response's policy version is then the oldest of them)."""
    lengths = [len(r.token_ids) for r in responses]
    packed = {
        "keys": torch.tensor([[r.prompt_index, r.sample_index, r.finish_reason == "stop"] for r in responses],
                             dtype=torch.int64).reshape(-1, 3),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "tokens": torch.tensor([t for r in responses for t in r.token_ids], dtype=torch.int64),
        "log_probs": torch.tensor([lp for r in responses for lp in r.log_probs], dtype=torch.float64),  # lossless
    }
    if responses and responses[0].routed_experts is not None:
        packed["routes"] = torch.cat([r.routed_experts for r in responses])
        packed["route_lengths"] = torch.tensor([r.routed_experts.shape[0] for r in responses], dtype=torch.int64)
    if responses and responses[0].loss_mask is not None:
        packed["loss_mask"] = torch.tensor([m for r in responses for m in r.loss_mask], dtype=torch.int8)
        packed["num_tool_calls"] = torch.tensor([r.num_tool_calls for r in responses], dtype=torch.int64)
    if responses and responses[0].token_versions is not None:
        packed["token_versions"] = torch.tensor([v for r in responses for v in r.token_versions], dtype=torch.int64)
    return packed


def unpack_responses(packed: dict[str, torch.Tensor]) -> list[RolloutResponse]:
    lengths = packed["lengths"].tolist()
    tokens, log_probs = packed["tokens"].split(lengths), packed["log_probs"].split(lengths)
    none = [None] * len(lengths)
    routes = packed["routes"].split(packed["route_lengths"].tolist()) if "routes" in packed else none
    loss_masks = [m.tolist() for m in packed["loss_mask"].split(lengths)] if "loss_mask" in packed else none
    tool_calls = packed["num_tool_calls"].tolist() if "num_tool_calls" in packed else none
    versions = [v.tolist() for v in packed["token_versions"].split(lengths)] if "token_versions" in packed else none
    return [RolloutResponse(prompt_index=int(key[0]), sample_index=int(key[1]), token_ids=t.tolist(),
                            log_probs=lp.tolist(), finish_reason="stop" if key[2] else "length",
                            routed_experts=experts, loss_mask=mask, num_tool_calls=calls, token_versions=version,
                            policy_version=min(version) if version else None)
            for key, t, lp, experts, mask, calls, version in zip(packed["keys"].tolist(), tokens, log_probs, routes,
                                                                  loss_masks, tool_calls, versions)]


def stamp_version(responses: list[RolloutResponse], version: int | None) -> list[RolloutResponse]:
    """The responses with `version` as their policy version, except those whose token versions say already
    (partial rollouts: the oldest of them)."""
    return [r if r.token_versions else dataclasses.replace(r, policy_version=version) for r in responses]


def build_rollout(cfg: MppoConfig, *, device: torch.device, dtype: torch.dtype, log_dir: Path,
                  layout: RolloutLayout | None = None) -> Rollout:
    """Every rank's Rollout for `cfg` (collective: every rank calls it, after torch.distributed is initialised).
    Engines start here; they are released at once (their memory is the trainer's until the first sync).
    `layout`: the rollout groups (None: launch_layout's of the whole launch)."""
    rollout_cfg = cfg.actor_rollout_ref.rollout
    name = rollout_cfg.name
    layout = layout or launch_layout(rollout_cfg.tensor_model_parallel_size)
    tp_group = object_group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        # gloo groups for Python objects (payload handles, responses): cheap on every backend. Every rank creates
        # every group, in the same order (torch.distributed's rule).
        for ranks in layout.groups:
            group = dist.new_group(list(ranks), backend="gloo")
            if layout.group_index == layout.groups.index(ranks) and len(ranks) > 1:
                tp_group = group
        object_group = dist.new_group(backend="gloo")
    spec = EngineSpec(cfg=cfg, layout=layout, tp_group=tp_group, device=device, dtype=dtype, log_dir=log_dir)
    engine = _start_everywhere(lambda: ENGINE_BUILDERS[name](spec), object_group)
    rollout = Rollout(name, engine, layout, free_cache_engine=rollout_cfg.free_cache_engine,
                      object_group=object_group, group_comm=tp_group, adapter_sync=adapter_sync(cfg))
    if rollout.free_cache_engine:
        engine.release()
    log.info("rollout: %d %s engine(s) of TP %d; this rank: group %d (ranks %s)", len(layout.groups), name,
             layout.engine_tp, layout.group_index, list(layout.ranks))
    return rollout


def _start_everywhere(start: Callable[[], RolloutEngine], group: Any | None) -> RolloutEngine:
    """Start this rank's engine; if any rank's start failed, every rank raises (the failing one its own error),
    so no rank is left waiting in the next collective for an engine that does not exist."""
    engine, error = None, None
    try:
        engine = start()
    except Exception as exc:  # noqa: BLE001 - re-raised below, on this rank and (as a summary) on the others
        error = exc
    if group is None:
        if error is not None:
            raise error
        return engine
    if error is not None:
        log.error("%s", error)  # at once: the other ranks may still be starting theirs
    failures: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(failures) if message is not None]
    if failed:
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()
        from mppo.rollout.sglang_startup import EngineStartError

        rank, message = failed[0]
        raise EngineStartError(f"rank {rank}'s rollout engine did not start ({message.splitlines()[0]})")
    return engine
