"""A Plan as text for the terminal and as a Markdown snippet for the README (`mppo plan --markdown`)."""
from __future__ import annotations

import math

from mppo.plan.catalog import GiB
from mppo.plan.memory import RoleLayout
from mppo.plan.planner import Plan, RolePlan

MiB = 1 << 20
PHASE_TEXT = {"update_actor": "actor update", "update_critic": "critic update", "old_log_prob": "old log-probs",
              "ref": "reference log-probs", "values": "critic values"}
SOURCES = ("Korthikanti et al. 2022 activation formulas (TP, and TP + sequence parallelism; / CP under context "
           "parallelism, + the all-gathered K/V of one layer), megatron DDP with "
           "fp32 main grads, Adam with fp32 master weights, SGLang KV sizing by mem_fraction_static")


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def size(n: float) -> str:
    return f"{n / MiB:.0f} MiB" if abs(n) < GiB else f"{n / GiB:.1f} GiB"


def count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def seconds(s: float) -> str:
    if not math.isfinite(s):
        return "n/a"
    return f"{s / 60:.1f} min" if s >= 600 else f"{s:.1f} s"


def layout_text(lay: RoleLayout) -> str:
    text = (f"TP{lay.tp} PP{lay.pp}" + (f" VPP{lay.vpp}" if lay.vpp else "") + (f" CP{lay.cp}" if lay.cp > 1 else "")
            + f" DP{lay.dp}" + (f" EP{lay.ep}" if lay.ep > 1 else ""))
    return text + (" (offloaded)" if lay.offloaded else "")


def _state_rows(r: RolePlan, dtype: str) -> list[tuple[str, str, float]]:
    lay, s = r.layout, r.state
    name = lay.role
    if not lay.trains:
        where = f"offloaded: {size(s.host_weights)} in host memory" if lay.offloaded else "frozen, no grads"
        return [(f"{name} weights", f"{count(s.params)} params x {dtype}; {where}", s.weights)]
    over = f"DP {lay.dp}" if lay.cp == 1 else f"DP x CP {lay.replicas}"  # megatron's data-parallel group with CP
    opt = (f"distributed over {over} (without: {size(s.optimizer_unsharded)})" if lay.distributed_optimizer
           else f"not distributed (distributed over {over}: {size(s.optimizer_unsharded / lay.replicas)})")
    if lay.lora is not None:
        adapters = f"LoRA rank {lay.lora.rank}: {count(s.adapter_params)} adapter params"
        return [(f"{name} weights", f"{count(s.params)} frozen base params x {dtype} + {adapters} x fp32", s.weights),
                (f"{name} gradients", "fp32 adapter grads only (megatron DDP buffer)", s.grads),
                (f"{name} optimizer", f"fp32 Adam m, v of the adapters; {opt}", s.optimizer)]
    return [(f"{name} weights", f"{count(s.params)} params x {dtype}", s.weights),
            (f"{name} gradients", "fp32 main grads (megatron DDP buffer)", s.grads),
            (f"{name} optimizer", f"fp32 Adam m, v{'' if dtype == 'fp32' else ' + master'}; {opt}", s.optimizer)]


def render_text(p: Plan) -> str:
    roll, lines = p.rollout, []
    add = lines.append
    add(f"mppo plan{': ' + p.source if p.source else ''}")
    unit = "GPU" if p.device.peak_flops else "rank"
    add(f"model    {p.model}: {count(p.params)} params, {p.dtype} weights, {p.attention} attention")
    if p.moe is not None:
        add(f"experts  EP{p.moe.ep}: {p.moe.experts_per_rank} experts of every MoE layer per rank "
            f"({count(p.moe.expert_params_per_rank)} params); all-to-all {size(p.moe.all_to_all_bytes_per_step)} "
            "sent per rank per step")
    add(f"device   {p.device.name}: {size(p.device.memory_bytes)} per {unit}; {p.world} {unit}s; sequences of "
        f"{p.sequence_len} tokens (prompt + response maximum)")
    add("layout   " + "; ".join(f"{r.layout.role} {layout_text(r.layout)}" for r in p.roles)
        + f"; rollout: {roll.engines} {roll.engine} engine(s) of TP{roll.engine_tp}")
    stage = p.roles[0].stage
    add("")
    add(f"memory per {unit} (pipeline stage {stage} of {p.roles[0].layout.pp}: the fullest)")
    rows = [row for r in p.roles for row in _state_rows(r, p.dtype)] + _host_rows(p)
    for name, note, value in rows:
        add(f"  {name:<18} {size(value):>10}  {note}")
    add(f"  {'resident':<18} {size(p.resident):>10}")
    if roll.held_during_training:
        add(f"training phase (the engine keeps {size(roll.held_during_training)}: rollout.free_cache_engine=false): "
            "working set on top of the resident state and the engine")
    elif p.engine_resident:
        add("training phase (the engine keeps its weights, frees its KV cache): working set on top of the resident "
            "state")
    else:
        add("training phase (the engine has released its memory): working set on top of the resident state")
    for r in p.roles:
        if r.layout.trains:
            lay = r.layout
            split = f" ({p.sequence_len // lay.cp} per CP rank)" if lay.cp > 1 else ""
            add(f"  {r.layout.role} activations: micro-batch {lay.micro_batch:g} x {p.sequence_len} tokens{split}, "
                f"recompute {lay.recompute}: {size(r.activations_per_micro_batch)} per micro-batch, "
                f"{size(r.activations_peak)} at the schedule's peak" + _kv_gather_note(r, p.sequence_len))
    for phase, value in p.training_phases.items():
        add(f"  {PHASE_TEXT[phase]:<20} {size(value):>10}")
    lp = p.logprob
    add(f"  log-prob working set ({lp.tokens:g} tokens): fused kernel {size(lp.fused_bytes)}, naive [tokens x vocab] "
        f"logits {size(lp.naive_bytes)} (configured: {lp.impl})")
    if p.allocator_retained:
        add(f"  {'allocator keeps':<20} {size(p.allocator_retained):>10}  the previous update's freed activations "
            "(glibc's heap: a CPU rank's resident set holds them beside the next update's)")
    verdict = "fits" if p.fits_training else "DOES NOT FIT"
    add(f"  peak ({PHASE_TEXT[p.peak_phase]}): {size(p.training_peak)} of {size(p.device.memory_bytes)}: {verdict}")
    if p.full_finetune is not None:
        full = p.full_finetune
        add(f"  LoRA vs full fine-tuning per {unit}: resident {size(p.resident)} vs {size(full.resident)}, training "
            f"peak {size(p.training_peak)} vs {size(full.training_peak)} (full: "
            f"{'fits' if full.fits else 'does not fit'}; its reference is a model of its own)")
    add(_rollout_text(p))
    add("")
    add(f"verdict: {'FITS' if p.fits else 'DOES NOT FIT'} on {p.device.name}")
    for s in p.suggestions:
        result = "fits" if s.fits else "still over"
        add(f"  try {' '.join(s.overrides)}  ({s.why}): training peak {gib(s.training_peak)} GiB, KV "
            f"{s.kv_tokens / 1e3:.0f}k tokens: {result}" + (f"; but: {s.problem}" if s.problem else ""))
    if not p.fits and not p.suggestions:
        add("  no single knob is enough: use more GPUs (trainer.nnodes) or a smaller model")
    if p.step is not None:
        add("")
        add(_step_text(p))
    add("")
    add(f"based on: {SOURCES}")
    return "\n".join(lines) + "\n"


def _kv_gather_note(r: RolePlan, seq: int) -> str:
    if r.layout.cp == 1:
        return ""
    return f" (with one layer's all-gathered K/V of the {seq} tokens and their grads: {size(r.cp_kv_gather)})"


def _host_rows(p: Plan) -> list[tuple[str, str, float]]:
    """The resident memory besides the models' state: the runtime, and the CPU engine's weights."""
    rows = []
    if p.runtime_reserve and p.device.peak_flops:
        rows.append(("runtime reserve", "CUDA context, NCCL buffers, fragmentation (rule of thumb)", p.runtime_reserve))
    elif p.runtime_reserve:
        rows.append(("process", "Python, torch, megatron-core, transformers, data (measured)", p.runtime_reserve))
    if p.engine_resident:
        rows.append(("engine weights", f"CPU engine, fp32 HF layout (TP{p.rollout.engine_tp}), kept between syncs",
                     p.engine_resident))
    return rows


def _rollout_text(p: Plan) -> str:
    r = p.rollout
    if r.engine == "sglang":
        free = r.device_memory - r.resident
        head = (f"rollout phase (SGLang takes gpu_memory_utilization {r.gpu_memory_utilization:g} of the {gib(free)} "
                f"GiB the training state leaves free = {gib(r.gpu_memory_utilization * free)} GiB)")
    else:
        head = f"rollout phase (CPU engine: {r.gpu_memory_utilization:.0%} of the rank's memory)"
    kv = (f"{gib(r.kv_cache)} GiB = {r.kv_tokens / 1e3:.0f}k tokens = {r.concurrent_sequences} sequences at once"
          if r.kv_cache > 0 else f"none ({gib(r.kv_cache)} GiB): the engine cannot start")
    kept = (f"training state kept {gib(r.resident)} GiB (offloaded to host: {gib(r.offloaded)} GiB)" if r.offloaded
            else f"training state kept {gib(r.resident)} GiB (nothing offloaded)")
    waves = math.ceil(r.sequences_per_engine / r.concurrent_sequences) if r.concurrent_sequences else 0
    weights = ("(engine weights included) + " if p.engine_resident
               else f"+ engine weights (TP{r.engine_tp}) {gib(r.weights)} GiB + ")
    return (f"{head}\n  {kept} {weights}KV cache {kv}\n  peak "
            f"{gib(r.peak)} of {gib(r.device_memory)} GiB; each engine generates {r.sequences_per_engine} sequences "
            f"per step" + (f" in {waves} wave(s)" if waves else "") + f": {'fits' if r.fits else 'DOES NOT FIT'}")


def _step_text(p: Plan) -> str:
    s = p.step
    assert s is not None
    parts = [("generation", s.generation_s), ("old log-probs", s.old_log_prob_s), ("ref", s.ref_s),
             ("values", s.values_s), ("critic update", s.update_critic_s), ("actor update", s.update_actor_s)]
    body = ", ".join(f"{name} {seconds(t)}" for name, t in parts if t)
    return (f"step time (MFU {s.mfu:g} of {s.peak_flops / 1e12:.0f} TFLOP/s, HBM {s.hbm_bytes_per_s / 1e12:.2f} TB/s, "
            f"maximum lengths): {seconds(s.total_s)}\n  {body}\n  generation = prefill {seconds(s.prefill_s)} + "
            f"decode {seconds(s.decode_s)} ({s.decode_waves} wave(s)); {s.tokens} tokens per step, "
            f"{s.tokens_per_s_per_gpu:.0f} tokens/s per GPU; weight sync and the optimizer step not included")


# ------------------------------------------------------------------------------------------------------ markdown
def render_markdown(plans: list[Plan]) -> str:
    """A README snippet: one summary table over the plans, then the per-GPU breakdown of each."""
    out = ["| recipe | model | GPUs | actor layout | resident | training peak | rollout KV cache | fits | step time |",
           "|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        r = p.rollout
        kv = f"{gib(r.kv_cache)} GiB ({r.concurrent_sequences} seqs)" if r.kv_cache > 0 else "none"
        out.append(f"| `{p.source}` | {p.model} | {p.world} x {p.device.name} | {layout_text(p.roles[0].layout)} | "
                   f"{gib(p.resident)} GiB | {gib(p.training_peak)} GiB ({PHASE_TEXT[p.peak_phase]}) | {kv} | "
                   f"{'yes' if p.fits else '**no**'} | {seconds(p.step.total_s) if p.step else 'n/a'} |")
    for p in plans:
        out += ["", f"**`{p.source}`** ({p.model}, {p.dtype}, {p.device.name}, pipeline stage {p.roles[0].stage}):", "",
                "| per GPU | GiB | |", "|---|---:|---|"]
        rows = [row for r in p.roles for row in _state_rows(r, p.dtype)]
        if p.runtime_reserve and p.device.peak_flops:
            rows.append(("runtime reserve", "CUDA context, NCCL, fragmentation", p.runtime_reserve))
        elif p.runtime_reserve:
            rows.append(("process", "Python, libraries, data (measured)", p.runtime_reserve))
        rows += [(f"{PHASE_TEXT[k]} working set", "training phase", v) for k, v in p.training_phases.items()]
        if p.allocator_retained:
            rows.append(("allocator keeps", "training phase: the previous update's freed activations", p.allocator_retained))
        if p.full_finetune is not None:
            rows.append(("full fine-tuning training peak", "the same config with lora.rank=0, for comparison",
                         p.full_finetune.training_peak))
        rows += [("engine weights", f"{'kept through training' if p.engine_resident else 'rollout phase'}, "
                                    f"TP{p.rollout.engine_tp}", p.rollout.weights),
                 ("engine KV cache", f"rollout phase, {p.rollout.kv_tokens / 1e3:.0f}k tokens", p.rollout.kv_cache)]
        out += [f"| {name} | {gib(value)} | {note} |" for name, note, value in rows]
        for s in p.suggestions[:3]:
            out.append(f"\nTo fit: `{' '.join(s.overrides)}` ({s.why}): training peak {gib(s.training_peak)} GiB"
                       + (", fits." if s.fits else ", still over.") + (f" Also: {s.problem}" if s.problem else ""))
    out += ["", f"Generated by `mppo plan ... --markdown`; {SOURCES}; MFU "
            f"{plans[0].step.mfu if plans and plans[0].step else 0.4:g}, maximum lengths."]
    return "\n".join(out) + "\n"
