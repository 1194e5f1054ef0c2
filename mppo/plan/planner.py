"""`plan(cfg, hf_args, device_memory_bytes) -> Plan`: per-GPU memory, fit verdict, knobs and step time of a config.

Two phases share each GPU (co-located design, the sequence of mppo.rollout.factory): TRAINING, where the rollout
engine has released its memory (rollout.free_cache_engine; otherwise it keeps it) and the actor, critic and
reference state plus the largest activation working set must fit; and ROLLOUT, where the engine holds its weights
and KV cache and the training state stays on the GPU except what `<role>.megatron.param_offload` (weights + grad
buffers) and `optimizer_offload` move to host memory. The trainer starts the engines after building the models,
with that state offloaded, so SGLang sizes its KV cache from the memory free in every rollout phase
(`gpu_memory_utilization` is SGLang's mem_fraction_static: KV = free_at_start x fraction - engine weights, the
rest of the free memory is left for its activations and CUDA graphs). The reported figures are those of the
worst rank (pipeline stage); every rank of a stage holds the same. On the CPU nothing is released or offloaded.

A CPU rank (`--device cpu`) is planned as its peak resident set (what `perf/cpu_memory_peak_gb` reports), so three
more terms count there: the process itself (CPU_RUNTIME), the CPU engine's weights, which stay in memory through
training (they are the weight exporter's shared-memory staging buffer, written in place by each sync), and what
glibc's allocator keeps: the activations an update frees stay in the heap and the next update allocates its own
beside them, so the peak holds about one more training working set (measured on SmolLM2-135M-Instruct with
configs/demo.yaml: the resident set rises by ~1.2-1.7 GiB over the live memory in the first steps, then stays;
1.6 GiB is the update's working set).
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mppo.config import MegatronConfig, MppoConfig, get_key, resolve
from mppo.config.decisions import (OldLogProbSource, old_log_prob_source, uses_critic, uses_reference,
                                   uses_sequence_parallel)
from mppo.config.lora import lora_enabled, lora_projections
from mppo.models.hf_config import HFModelArgs
from mppo.plan import memory as mem
from mppo.plan.catalog import DEVICES, DeviceSpec, GiB
from mppo.plan.timing import StepTime, Workload, bubble, forward_flops, generation_time, training_flops

RUNTIME_RESERVE = 3 * GiB  # CUDA context, NCCL buffers, allocator fragmentation: a rule of thumb, not measured
# A CPU rank before it builds a model: Python with torch, megatron-core, transformers and mppo imported, the
# tokenizer and the data loaded. Measured: 0.52-0.53 GiB resident on each of 2 ranks (configs/demo.yaml).
CPU_RUNTIME = GiB // 2
FORWARD_PHASE = {"actor": "old_log_prob", "ref": "ref", "critic": "values"}
MEGATRON = {"actor": "actor_rollout_ref.actor.megatron", "critic": "critic.megatron",
            "ref": "actor_rollout_ref.ref.megatron"}


@dataclass(frozen=True)
class RolePlan:
    layout: mem.RoleLayout
    stage: int  # the pipeline stage reported
    state: mem.ModelState
    activations_per_micro_batch: float  # one training micro-batch on this stage (0 for the reference)
    activations_peak: float  # at the schedule's peak (micro-batches in flight; + one recomputed layer)
    forward_working_set: float  # its no-grad forward pass (log-probs or values)
    cp_kv_gather: float = 0.0  # in activations_peak: one layer's all-gathered K/V and their grads (CP only)


@dataclass(frozen=True)
class LogProbPlan:
    impl: str  # configured: fused | naive
    tokens: float  # tokens of the largest actor/ref micro-batch on one rank (1/CP of its sequences)
    fused_bytes: float
    naive_bytes: float


@dataclass(frozen=True)
class RolloutPlan:
    engine: str  # sglang | cpu
    engine_tp: int
    engines: int
    gpu_memory_utilization: float  # SGLang: share of the memory free at its start; CPU engine: share of the rank's
    resident: float  # training state kept on the device + runtime reserve on the worst rank while the engine runs
    offloaded: float  # training state moved to host memory for the rollout (param_offload / optimizer_offload)
    weights: float  # engine weight shard per GPU
    kv_cache: float  # bytes per GPU (negative: the engine cannot start)
    kv_bytes_per_token: int
    sequence_len: int
    sequences_per_engine: int
    peak: float  # device bytes in use while the engine generates (resident + the engine's share)
    device_memory: int
    held_during_training: float  # engine bytes that stay allocated while the trainer trains (free_cache_engine off)

    @property
    def kv_tokens(self) -> int:
        return max(0, int(self.kv_cache // self.kv_bytes_per_token))

    @property
    def concurrent_sequences(self) -> int:
        return self.kv_tokens // self.sequence_len

    @property
    def fits(self) -> bool:
        return self.concurrent_sequences >= 1 and self.peak <= self.device_memory


@dataclass(frozen=True)
class MoEPlan:
    """The actor's routed experts on one rank (MoE models)."""

    ep: int
    experts_per_rank: int  # of every MoE layer
    expert_params_per_rank: int  # routed-expert parameters on the reported stage
    all_to_all_bytes_per_step: float  # token dispatch + combine sent by one rank in one step (all passes)


@dataclass(frozen=True)
class Suggestion:
    overrides: tuple[str, ...]  # key=value overrides to try
    why: str
    training_peak: float
    kv_tokens: int
    fits: bool
    problem: str | None  # the config error the overrides cause (other keys must change too), if any


@dataclass(frozen=True)
class FullFinetunePlan:
    """The same config with LoRA off (lora.rank=0): the actor's full weights trained, the reference its own model."""

    resident: float
    training_peak: float
    fits: bool


@dataclass
class Plan:
    model: str
    params: int
    device: DeviceSpec
    dtype: str  # parameter dtype: bf16 | fp32
    attention: str  # flash (Transformer Engine or SDPA) | unfused (local spec)
    world: int
    sequence_len: int
    roles: list[RolePlan]
    runtime_reserve: int
    training_phases: dict[str, float]  # phase -> working set on the reported stage
    logprob: LogProbPlan
    rollout: RolloutPlan
    step: StepTime | None
    suggestions: list[Suggestion] = field(default_factory=list)
    source: str = ""  # the config file planned
    moe: MoEPlan | None = None
    engine_resident: float = 0.0  # rollout weights kept through training (the CPU engine's; SGLang releases its)
    allocator_retained: float = 0.0  # CPU: freed activations glibc keeps in the heap (one training working set)
    full_finetune: FullFinetunePlan | None = None  # a LoRA actor: the full fine-tuning plan to compare with

    @property
    def resident(self) -> float:
        return sum(r.state.total for r in self.roles) + self.runtime_reserve + self.engine_resident

    @property
    def training_peak(self) -> float:
        return (self.resident + self.rollout.held_during_training + max(self.training_phases.values())
                + self.allocator_retained)

    @property
    def peak_phase(self) -> str:
        return max(self.training_phases, key=self.training_phases.get)

    @property
    def fits_training(self) -> bool:
        return self.training_peak <= self.device.memory_bytes

    @property
    def fits(self) -> bool:
        return self.fits_training and self.rollout.fits

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(resident=self.resident, training_peak=self.training_peak, peak_phase=self.peak_phase,
                   fits_training=self.fits_training, fits_rollout=self.rollout.fits, fits=self.fits)
        out["rollout"].update(kv_tokens=self.rollout.kv_tokens,
                              concurrent_sequences=self.rollout.concurrent_sequences)
        if self.step is not None:
            out["step"].update(total_s=self.step.total_s, tokens_per_s_per_gpu=self.step.tokens_per_s_per_gpu)
        return _finite(out)


def _finite(value: Any) -> Any:
    """JSON has no infinity: a time that cannot be estimated (no KV cache) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------- layouts
def _layouts(cfg: MppoConfig, world: int, seq: int) -> list[mem.RoleLayout]:
    arr, n, samples = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout.n, cfg.data.train_batch_size
    dynamic = arr.actor.use_dynamic_bsz
    lora = arr.model.lora
    adapters = (mem.LoRALayout(lora.rank, lora_projections(lora.target_modules, lora.exclude_modules))
                if lora_enabled(cfg) else None)
    roles = [("actor", arr.actor, True)]
    roles += [("critic", cfg.critic, True)] if uses_critic(cfg) else []
    # LoRA: the reference is the actor's own frozen base (its adapters off), no model of its own
    roles += [("ref", arr.ref, False)] if uses_reference(cfg) and not lora_enabled(cfg) else []
    out = []
    for role, section, trains in roles:
        m = section.megatron
        tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, _context_parallel_size(m)
        if world % (tp * pp):
            raise mem.PlanError(f"{MEGATRON[role]}: TP x PP = {tp * pp} does not divide the {world} GPUs")
        if cp < 1 or world % (tp * pp * cp):
            raise mem.PlanError(f"{MEGATRON[role]}.context_parallel_size = {cp}: TP x PP x CP = {tp} x {pp} x {cp} "
                                f"does not divide the {world} GPUs; choose a context_parallel_size that divides "
                                f"{world // (tp * pp)}")
        dp, ep = world // (tp * pp * cp), m.expert_model_parallel_size
        if dp % ep:
            raise mem.PlanError(f"{MEGATRON[role]}: EP = {ep} does not divide DP = {dp}; choose an "
                                "expert_model_parallel_size that divides the data-parallel size")
        if trains:  # a token budget is per GPU: under CP a micro-batch holds CP x the budget, 1/CP on each rank
            budget = section.ppo_max_token_len_per_gpu * cp / seq
            micro = budget if section.use_dynamic_bsz else section.ppo_micro_batch_size_per_gpu
            fwd = arr.rollout.log_prob_micro_batch_size_per_gpu if role == "actor" else micro
            per_rank = section.ppo_mini_batch_size * n / dp
        else:
            micro, fwd, per_rank = 0, section.log_prob_micro_batch_size_per_gpu, samples * n / dp
        if dynamic and role != "critic":
            fwd = arr.actor.ppo_max_token_len_per_gpu * cp / seq
        out.append(mem.RoleLayout(
            role=role, tp=tp, pp=pp, vpp=m.virtual_pipeline_model_parallel_size, dp=dp,
            distributed_optimizer=bool(m.use_distributed_optimizer), recompute=m.recompute, micro_batch=micro,
            forward_micro_batch=fwd, micro_batches_per_step=max(1, int(per_rank // max(micro or fwd, 1))),
            trains=trains, offloaded=role == "ref" and arr.ref.offload_to_cpu, ep=ep,
            sp=uses_sequence_parallel(m) and tp > 1, cp=cp, lora=adapters if role == "actor" else None))
    return out


def _context_parallel_size(m: MegatronConfig) -> int:
    """CP of a role's layout (resolved: the critic's and reference's null is the actor's)."""
    return m.context_parallel_size


def _role_plan(a: HFModelArgs, lay: mem.RoleLayout, prec: mem.Precision, seq: int, stage: int,
               fused: bool) -> tuple[RolePlan, dict[str, float]]:
    """The role's state on `stage` and the working set of each phase it runs there."""
    state = mem.model_state(a, lay, prec, stage)
    last = stage == lay.pp - 1
    phases: dict[str, float] = {}
    per_micro = peak = 0.0
    if lay.trains:
        per_micro, peak = mem.training_activations(a, lay, prec, seq, stage)
        logits = (mem.logprob_bytes(a, lay.tp, lay.micro_batch * seq / lay.cp, prec, fused) if lay.role == "actor"
                  else 0)
        phases[f"update_{lay.role}"] = peak + (logits if last else 0)
    fwd = mem.forward_only_bytes(a, lay.tp, seq, lay.forward_micro_batch, prec, sp=lay.sp, cp=lay.cp)
    if last and lay.role != "critic":
        fwd += mem.logprob_bytes(a, lay.tp, lay.forward_micro_batch * seq / lay.cp, prec, fused)
    phases[FORWARD_PHASE[lay.role]] = fwd + state.host_weights  # an offloaded ref is swapped in to run
    gather = mem.cp_kv_gather_bytes(a, lay.tp, seq, lay.micro_batch, prec, lay.cp, backward=True) if lay.trains else 0
    return RolePlan(lay, stage, state, per_micro, peak, fwd, gather), phases


def _stage_peak(roles: list[RolePlan], phases: dict[str, float]) -> float:
    return sum(r.state.total for r in roles) + max(phases.values())


def _worst_stage(a: HFModelArgs, lay: mem.RoleLayout, prec: mem.Precision, seq: int, fused: bool) -> int:
    def peak(stage: int) -> float:
        role, phases = _role_plan(a, lay, prec, seq, stage, fused)
        return _stage_peak([role], phases)

    return max(range(lay.pp), key=peak)


def _memory(a: HFModelArgs, layouts: list[mem.RoleLayout], prec: mem.Precision, seq: int, fused: bool
            ) -> tuple[list[RolePlan], dict[str, float], float]:
    """(role plans, phase working sets) of the worst stage, and the largest resident state of any stage."""
    if len({lay.pp for lay in layouts}) == 1:  # same pipeline: rank r is stage k of every model
        candidates = [[(lay, k) for lay in layouts] for k in range(layouts[0].pp)]
    else:  # different pipelines: each model's worst stage, summed (an upper bound)
        candidates = [[(lay, _worst_stage(a, lay, prec, seq, fused)) for lay in layouts]]
    best: tuple[float, list[RolePlan], dict[str, float]] | None = None
    resident = 0.0
    for stage_set in candidates:
        plans, phases = [], {}
        for lay, k in stage_set:
            rp, ph = _role_plan(a, lay, prec, seq, k, fused)
            plans.append(rp)
            phases.update(ph)
        resident = max(resident, sum(r.state.total for r in plans))
        peak = _stage_peak(plans, phases)
        if best is None or peak > best[0]:
            best = (peak, plans, phases)
    assert best is not None
    return best[1], best[2], resident


# ------------------------------------------------------------------------------------------------------ plan
def plan(cfg: MppoConfig, hf_args: HFModelArgs, device_memory_bytes: int | None = None, *, device: str = "h100",
         mfu: float = 0.4, model_name: str = "", suggest: bool = True) -> Plan:
    """Per-GPU memory and step time of `cfg` for the model `hf_args` on `device` (h100, h200 or cpu).

    `device_memory_bytes` overrides the device's memory. On "cpu" the memory is this host's RAM shared by the
    node's ranks and no step time is estimated. Raises PlanError when the layout cannot hold the model.
    """
    cfg = resolve(cfg)
    spec = cpu_device(cfg.trainer.n_gpus_per_node) if device == "cpu" else DEVICES[device]
    if device_memory_bytes is not None:
        spec = DeviceSpec(f"{spec.name}, {device_memory_bytes / GiB:.0f} GiB", int(device_memory_bytes),
                          spec.hbm_bytes_per_s, spec.peak_flops)
    on_gpu = device != "cpu"
    arr = cfg.actor_rollout_ref
    dtype = arr.model.dtype if arr.model.dtype != "auto" else ("bf16" if on_gpu else "fp32")
    flash = arr.model.transformer_impl != "local"  # TE and SDPA attention keep no [s, s] scores
    prec = mem.Precision.for_dtype(2 if dtype == "bf16" else 4, flash)
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    layouts = _layouts(cfg, world, seq)
    for lay in layouts:
        mem.check_layout(hf_args, lay)
    fused = arr.actor.logprob_impl == "fused"
    roles, phases, resident = _memory(hf_args, layouts, prec, seq, fused)
    reserve = RUNTIME_RESERVE if on_gpu else CPU_RUNTIME
    cpu_engine = arr.rollout.name != "sglang"
    engine_resident = mem.engine_weight_bytes(hf_args, arr.rollout.tensor_model_parallel_size, 4) if cpu_engine else 0

    actor = layouts[0]
    lp_tokens = (max(actor.micro_batch, *(lay.forward_micro_batch for lay in layouts if lay.role != "critic"))
                 * seq / actor.cp)  # on one rank
    logprob = LogProbPlan(arr.actor.logprob_impl, lp_tokens,
                          fused_bytes=mem.logprob_bytes(hf_args, actor.tp, lp_tokens, prec, True),
                          naive_bytes=mem.logprob_bytes(hf_args, actor.tp, lp_tokens, prec, False))
    kept, offloaded = _kept_during_rollout(cfg, roles, on_gpu)
    rollout = _rollout(cfg, hf_args, spec, kept + reserve + engine_resident, offloaded, world, seq)
    step = _step_time(cfg, hf_args, layouts, rollout, spec, world, mfu) if spec.peak_flops else None
    result = Plan(model=model_name or hf_args.model_type, params=mem.total_params(hf_args), device=spec, dtype=dtype,
                  attention="flash (Transformer Engine or SDPA)" if flash else "unfused (local spec)", world=world,
                  sequence_len=seq, roles=roles, runtime_reserve=reserve, training_phases=phases, logprob=logprob,
                  rollout=rollout, step=step, moe=_moe(cfg, hf_args, layouts, roles, prec, seq),
                  engine_resident=engine_resident, allocator_retained=0.0 if on_gpu else max(phases.values()),
                  full_finetune=_full_finetune(cfg, hf_args, device_memory_bytes, device, mfu))
    if suggest and not result.fits:
        from mppo.plan.knobs import suggestions  # knobs re-plans trial configs with this function

        result.suggestions = suggestions(cfg, hf_args, result, device=device, device_memory_bytes=device_memory_bytes,
                                         mfu=mfu)
    return result


def _full_finetune(cfg: MppoConfig, a: HFModelArgs, device_memory_bytes: int | None, device: str, mfu: float
                   ) -> FullFinetunePlan | None:
    """A LoRA config planned again with LoRA off, for the LoRA vs full fine-tuning comparison (None without LoRA)."""
    if not lora_enabled(cfg):
        return None
    full = copy.deepcopy(cfg)
    full.actor_rollout_ref.model.lora.rank = 0
    p = plan(full, a, device_memory_bytes, device=device, mfu=mfu, suggest=False)
    return FullFinetunePlan(p.resident, p.training_peak, p.fits)


def _moe(cfg: MppoConfig, a: HFModelArgs, layouts: list[mem.RoleLayout], roles: list[RolePlan],
         prec: mem.Precision, seq: int) -> MoEPlan | None:
    """Experts per rank and the all-to-all traffic of one step: the old-log-prob and reference forwards once, each
    update epoch forward and backward (the critic, a value model, is not counted)."""
    if not a.is_moe:
        return None
    actor = layouts[0]
    tokens = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n * seq / actor.replicas  # on one rank
    actor_pass = old_log_prob_source(cfg) is OldLogProbSource.ACTOR_PASS
    passes = 2 * cfg.actor_rollout_ref.actor.ppo_epochs + int(actor_pass) + int(uses_reference(cfg))
    stage = next(r.stage for r in roles if r.layout.role == "actor")
    return MoEPlan(actor.ep, a.num_experts // actor.ep, mem.stage_expert_params(a, actor, stage),
                   passes * mem.all_to_all_bytes(a, tokens, actor.ep, prec.act_bytes))


def cpu_device(ranks_per_node: int) -> DeviceSpec:
    """One CPU rank: this host's RAM split over the node's ranks; no FLOP or bandwidth figures."""
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceSpec(f"CPU rank (host RAM / {ranks_per_node} ranks)", ram // max(1, ranks_per_node), None, None)


def _kept_during_rollout(cfg: MppoConfig, roles: list[RolePlan], on_gpu: bool) -> tuple[float, float]:
    """(training state bytes that stay on the device while the engine generates, bytes offloaded to host) of the
    reported stage. param_offload moves weights + grad buffers, optimizer_offload the optimizer state; both do
    nothing on the CPU, where the state is in host memory already (mppo.workers.offload)."""
    kept = offloaded = 0.0
    for r in roles:
        m = get_key(cfg, MEGATRON[r.layout.role])
        out = 0.0
        if on_gpu and m.param_offload:
            out += r.state.weights + r.state.grads
        if on_gpu and m.optimizer_offload:
            out += r.state.optimizer
        kept += r.state.total - out
        offloaded += out
    return kept, offloaded


def _rollout(cfg: MppoConfig, a: HFModelArgs, spec: DeviceSpec, resident: float, offloaded: float, world: int,
             seq: int) -> RolloutPlan:
    r = cfg.actor_rollout_ref.rollout
    tp = r.tensor_model_parallel_size
    engines = max(1, world // tp)
    per_engine = math.ceil(cfg.data.train_batch_size * r.n / engines)
    if r.name == "sglang":  # bf16 weights and KV; the pool fills the free memory up to the fraction
        weights = mem.engine_weight_bytes(a, tp, 2)
        kv_token = mem.kv_bytes_per_token(a, tp, 2)
        share = r.gpu_memory_utilization * (spec.memory_bytes - resident)
        kv = share - weights
        fraction, peak = r.gpu_memory_utilization, resident + share
        held = 0.0 if r.free_cache_engine else share
    else:  # the CPU engine: fp32 weights (already in `resident`: the exporter's staging buffer, kept through
        # training whatever free_cache_engine says), a KV cache only for the batch it generates
        weights = mem.engine_weight_bytes(a, tp, 4)
        kv_token = mem.kv_bytes_per_token(a, tp, 4)
        kv = per_engine * seq * kv_token
        peak = resident + kv
        fraction = peak / spec.memory_bytes
        held = 0.0
    return RolloutPlan(r.name, tp, engines, fraction, resident, offloaded, weights, kv, kv_token, seq, per_engine,
                       peak, spec.memory_bytes, held)


def _step_time(cfg: MppoConfig, a: HFModelArgs, layouts: list[mem.RoleLayout], rollout: RolloutPlan,
               spec: DeviceSpec, world: int, mfu: float) -> StepTime:
    assert spec.peak_flops and spec.hbm_bytes_per_s
    d, r = cfg.data, cfg.actor_rollout_ref.rollout
    seq, samples = rollout.sequence_len, d.train_batch_size * r.n
    tokens = samples * seq
    cluster = world * spec.peak_flops * mfu
    times = {"actor": 0.0, "critic": 0.0, "ref": 0.0, "update_actor": 0.0, "update_critic": 0.0}
    for lay in layouts:
        fwd_micro = samples / lay.dp / max(lay.forward_micro_batch, 1e-9)
        times[lay.role] = forward_flops(a, lay.role, tokens, seq) / cluster * bubble(lay, fwd_micro)
        if lay.trains:
            epochs = (cfg.actor_rollout_ref.actor if lay.role == "actor" else cfg.critic).ppo_epochs
            times[f"update_{lay.role}"] = (training_flops(a, lay, tokens, seq, epochs) / cluster
                                           * bubble(lay, lay.micro_batches_per_step))
    work = Workload(samples, d.max_prompt_length, d.max_response_length, world, rollout.engine_tp, rollout.weights,
                    rollout.kv_bytes_per_token, max(rollout.kv_tokens, 0))
    prefill, decode, waves = generation_time(a, work, spec.peak_flops, mfu, spec.hbm_bytes_per_s)
    actor_pass = old_log_prob_source(cfg) is OldLogProbSource.ACTOR_PASS
    return StepTime(mfu=mfu, world=world, peak_flops=spec.peak_flops, hbm_bytes_per_s=spec.hbm_bytes_per_s,
                    tokens=tokens, generation_s=prefill + decode, prefill_s=prefill, decode_s=decode,
                    decode_waves=waves, old_log_prob_s=times["actor"] if actor_pass else 0.0,
                    ref_s=times["ref"], values_s=times["critic"],
                    update_critic_s=times["update_critic"], update_actor_s=times["update_actor"])
