"""`mppo bench long-context`: one long sequence (prompt + response) through the three passes a PPO step makes on
it, the actor's old-log-prob pass, the reference's log-prob pass and the actor's update, at several context
parallel sizes: the peak memory each rank needs, and the log-probs against CP1.

    mppo bench long-context [--tokens 32768] [--prompt 1024] [--cps 1,2,4] [--hidden 128 --layers 4 ...]

Each CP size is its own fresh torchrun launch of CP ranks (DP1: a DP replica would repeat the same per-rank work on
another sequence), building the real workers (mppo.workers: ActorWorker, ReferenceWorker) on a random Qwen2 with
mppo's SDPA attention spec, fp32 on the CPU. Every rank holds the whole sequence's batch; the workers split it with
megatron's load-balanced CP split (2·CP chunks, rank r holds r and 2·CP-1-r).

Memory, per pass and rank: the peak resident set during the pass minus the resident set just before it (the
kernel's high-water mark VmHWM, reset before each pass by writing 5 to /proc/self/clear_refs, after glibc's
malloc_trim returned what earlier passes freed, so a pass never reuses pages it is not charged for); on CUDA
torch.cuda.max_memory_allocated() minus memory_allocated() before, the peak stats reset. Printed: the largest rank's
figure per pass, and each CP's over CP1's (ideal: 1/CP; K/V are all-gathered over CP, so each rank still holds the
whole sequence's K/V per layer, which the GQA model keeps small).
Correctness, on the same run: max |log-prob - CP1's| of the old-log-prob and reference passes (the same weights:
equal up to float summation order), and the update's grad norm relative to CP1's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mppo.bench.fresh_process import run_torchrun
from mppo.bench.step import CACHE, cpu_cores, load_average

PASSES = ("old_log_prob", "ref", "update")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench long-context", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768, help="prompt + response tokens of the one sequence")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (the rest is the response)")
    p.add_argument("--cps", default="1,2,4", help="comma list of context parallel sizes (the first is the baseline)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                   help="actor.megatron.recompute of the update")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per rank")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per launch")
    p.add_argument("--json", type=Path, default=None, help="also write all measurements here")
    return p


def check_options(opts: argparse.Namespace) -> list[int]:
    """The CP sizes, or a ValueError naming the option to fix."""
    try:
        cps = [int(c) for c in opts.cps.split(",")]
    except ValueError:
        raise ValueError(f"--cps must be a comma list of integers, got {opts.cps!r}") from None
    if not cps or min(cps) < 1:
        raise ValueError(f"--cps must list sizes >= 1, got {opts.cps!r}")
    for cp in cps:
        if opts.tokens % (2 * cp):
            raise ValueError(f"--tokens {opts.tokens} is not divisible by 2*CP = {2 * cp} (megatron's load-balanced "
                             "split); pick a multiple")
    if not 0 < opts.prompt < opts.tokens:
        raise ValueError(f"--prompt must be between 1 and --tokens - 1, got {opts.prompt}")
    return cps


def model_dir(opts: argparse.Namespace) -> Path:
    """A random Qwen2 HF directory of the options' shape, cached under ~/.cache/mppo-bench."""
    shape = f"h{opts.hidden}-i{opts.intermediate}-l{opts.layers}-a{opts.heads}-kv{opts.kv_heads}-v{opts.vocab}"
    path = CACHE / "long-context" / f"{shape}-pos{opts.tokens}"
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=opts.hidden, intermediate_size=opts.intermediate, num_hidden_layers=opts.layers,
                         num_attention_heads=opts.heads, num_key_value_heads=opts.kv_heads, vocab_size=opts.vocab,
                         max_position_embeddings=opts.tokens, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(dir=path.parent if path.parent.exists() else None))
    model.save_pretrained(tmp, safe_serialization=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, path)  # whole or absent: a killed write never leaves a half model in the cache
    return path


def run(opts: argparse.Namespace) -> dict[str, Any]:
    cps = check_options(opts)
    hf = model_dir(opts)
    cases = []
    with tempfile.TemporaryDirectory(prefix="mppo-bench-long-context-") as work:
        for cp in cps:
            spec, out = Path(work) / f"spec{cp}.json", Path(work) / f"result{cp}.json"
            spec.write_text(json.dumps({**vars(opts), "json": None, "cp": cp, "hf": str(hf), "out": str(out)}))
            load_before = load_average()
            threads = max(1, cpu_cores() // cp) if opts.device == "cpu" else 1
            run_torchrun("mppo.bench.long_context", ["--rank-worker", str(spec)], nproc=cp, threads=threads,
                         timeout_s=opts.timeout, device=opts.device, expect=out)
            case = json.loads(out.read_text())
            case["load"] = {"before": load_before, "after": load_average()}
            cases.append(case)
    return {"cases": cases, "summaries": summarize(cases), "cores": cpu_cores()}


def summarize(cases: list[dict]) -> list[dict]:
    """Per CP: the largest rank's extra bytes per pass and over the step, their ratios to the first case's, the
    log-prob differences and the grad norm's relative difference from the first case's."""
    base = cases[0]
    rows = []
    for case in cases:
        peak = {p: max(rank[p]["extra_bytes"] for rank in case["ranks"]) for p in PASSES}
        base_peak = {p: max(rank[p]["extra_bytes"] for rank in base["ranks"]) for p in PASSES}
        step, base_step = max(peak.values()), max(base_peak.values())
        rows.append({
            "cp": case["cp"], "ranks": len(case["ranks"]),
            "extra_mib": {p: peak[p] / 2**20 for p in PASSES}, "step_extra_mib": step / 2**20,
            "ratio": {p: peak[p] / max(base_peak[p], 1) for p in PASSES}, "step_ratio": step / max(base_step, 1),
            "seconds": {p: max(rank[p]["seconds"] for rank in case["ranks"]) for p in PASSES},
            "log_prob_diff": _max_diff(case["old_log_probs"], base["old_log_probs"]),
            "ref_log_prob_diff": _max_diff(case["ref_log_probs"], base["ref_log_probs"]),
            "grad_norm": case["grad_norm"],
            "grad_norm_rel_diff": abs(case["grad_norm"] - base["grad_norm"]) / max(abs(base["grad_norm"]), 1e-30),
        })
    return rows


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def describe(opts: argparse.Namespace, out: dict) -> str:
    first = out["cases"][0]
    loads = ", ".join(f"CP{c['cp']} {c['load']['before']:.1f} -> {c['load']['after']:.1f}" for c in out["cases"])
    return "\n".join([
        f"mppo bench long-context: one sequence of {opts.tokens} tokens ({opts.prompt} prompt + "
        f"{opts.tokens - opts.prompt} response), random Qwen2 (hidden {opts.hidden}, {opts.layers} layers, "
        f"{opts.heads} heads / {opts.kv_heads} KV heads, vocab {opts.vocab}, {first['num_parameters'] / 1e6:.2f}M "
        f"parameters, {first['dtype']}), core attention {first['core_attention']}, recompute {opts.recompute}",
        f"memory: {first['memory_method']}; the largest rank's figure per pass",
        f"{out['cores']} cores; load average (1 min) before -> after: {loads}",
    ])


def render(rows: list[dict]) -> str:
    head = (f"{'CP':>3} {'ranks':>5} | {'old-log-prob':>12} {'ref':>9} {'update':>9} MiB | "
            f"{'step':>9} MiB {'x CP1':>7} | {'lp diff':>9} {'ref diff':>9} {'gnorm rel':>9} | seconds (lp/ref/upd)")
    lines = [head, "-" * len(head)]
    for r in rows:
        mib, secs = r["extra_mib"], r["seconds"]
        lines.append(f"{r['cp']:>3} {r['ranks']:>5} | {mib['old_log_prob']:>12.1f} {mib['ref']:>9.1f} "
                     f"{mib['update']:>9.1f}     | {r['step_extra_mib']:>9.1f}     {r['step_ratio']:>7.3f} | "
                     f"{r['log_prob_diff']:>9.2e} {r['ref_log_prob_diff']:>9.2e} {r['grad_norm_rel_diff']:>9.2e} | "
                     f"{secs['old_log_prob']:.1f}/{secs['ref']:.1f}/{secs['update']:.1f}")
    lines.append("per pass x CP1: " + "; ".join(
        f"CP{r['cp']} " + " ".join(f"{p} {r['ratio'][p]:.3f}" for p in PASSES) for r in rows))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ ranks
class PeakMemory:
    """The extra memory of a block: on CUDA the caching allocator's peak over what was allocated before; on the CPU
    the resident set's high-water mark over the resident set before (VmHWM reset through /proc/self/clear_refs)."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.method = ("torch.cuda.max_memory_allocated - memory_allocated before (peak stats reset per pass)"
                       if self.cuda else "peak resident set (VmHWM, reset per pass) - resident set before")

    def __enter__(self) -> "PeakMemory":
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            _return_free_heap()  # what an earlier pass freed must not be counted as this pass's baseline
            with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
                f.write("5")
            self.before = _status_kib("VmRSS") * 1024
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_kib("VmHWM") * 1024
        self.result = {"extra_bytes": max(peak - self.before, 0), "seconds": time.perf_counter() - self.start}


def _return_free_heap() -> None:
    """glibc's malloc_trim(0): freed heap pages back to the OS (a no-op where there is no glibc)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this bench measures CPU memory on Linux only")


def rank_main(spec_path: str) -> None:
    """Build actor and reference at CP = WORLD_SIZE, run the three passes on the one sequence, measure each."""
    import logging
    import warnings

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from mppo.config.schema import ActorConfig, MegatronConfig, ModelConfig, OptimConfig, RefConfig
    from mppo.parallel import destroy, init_distributed
    from mppo.workers.actor import ActorWorker
    from mppo.workers.reference import ReferenceWorker

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dims = init_distributed(1, 1, cp=spec["cp"], seed=0)
    megatron = MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              context_parallel_size=spec["cp"], use_distributed_optimizer=False,
                              recompute=spec["recompute"], seed=0)
    model_cfg = ModelConfig(path=spec["hf"], transformer_impl="sdpa", dtype="fp32")
    actor_cfg = ActorConfig(ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, logprob_impl="fused",
                            kernel_backend="torch", use_kl_loss=True, optim=OptimConfig(lr=1e-4, weight_decay=0.0),
                            megatron=megatron)
    actor = ActorWorker(model_cfg, actor_cfg, dims, spec["hf"], total_steps=1)
    ref = ReferenceWorker(model_cfg, RefConfig(log_prob_micro_batch_size_per_gpu=1, megatron=megatron), dims,
                          spec["hf"], logprob_impl="fused", kernel_backend="torch")
    batch = _one_sequence(spec["vocab"], spec["prompt"], spec["tokens"] - spec["prompt"])
    memory = PeakMemory(dims.device)
    measured = {}
    with memory:
        batch["old_log_probs"] = actor.compute_log_prob(batch, temperature=1.0)
    measured["old_log_prob"] = memory.result
    with memory:
        batch["ref_log_prob"] = ref.compute_log_prob(batch, temperature=1.0)
    measured["ref"] = memory.result
    with memory:
        metrics = actor.update(batch, temperature=1.0)
    measured["update"] = memory.result
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, measured)
    if dist.get_rank() == 0:
        core = type(actor.model[0].module.decoder.layers[0].self_attention.core_attention).__name__
        Path(spec["out"]).write_text(json.dumps({
            "cp": spec["cp"], "ranks": ranks, "grad_norm": float(metrics["actor/grad_norm"]),
            "skipped": bool(metrics["skipped"]), "core_attention": core, "memory_method": memory.method,
            "dtype": str(actor.dtype).removeprefix("torch."),
            "num_parameters": sum(p.numel() for chunk in actor.model for p in chunk.parameters()),
            "old_log_probs": batch["old_log_probs"][0].tolist(), "ref_log_probs": batch["ref_log_prob"][0].tolist(),
        }))
    destroy(process_group=True)


def _one_sequence(vocab: int, prompt: int, response: int) -> dict:
    """The workers' data contract for one unpadded prompt + response (the same on every rank: a fixed seed)."""
    import torch

    g = torch.Generator().manual_seed(0)
    total = prompt + response
    ids = torch.randint(1, vocab, (1, total), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(1, total, dtype=torch.long),
            "position_ids": torch.arange(total)[None], "responses": ids[:, prompt:].clone(),
            "response_mask": torch.ones(1, response), "advantages": torch.randn(1, response, generator=g)}


def main(argv: list[str] | None = None) -> int:
    from mppo.bench.step import run_and_report

    return run_and_report("long-context", _parser().parse_args(argv), run, describe, render)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_main(sys.argv[2])
    else:
        sys.exit(main())
