"""`mppo bench step`: time whole PPO (GAE + critic) and GRPO steps, phase by phase, on this machine.

    mppo bench step [CONFIG.yaml] [key=value ...] [--nproc 2] [--warmup 1 --steps 2 --repeats 3]

Each estimator runs in its own `torchrun` launch of this module (every rank builds the real PPOTrainer and calls
`train_step`), on bench assets made locally (mppo.bench.assets: countdown prompts, a random Qwen2 whose EOS
probability spreads response lengths widely). Per phase it prints the median over repeats of the mean seconds
per step (a repeat is `--steps` consecutive steps, after `--warmup` steps), tokens per second (prompt + response
tokens of the global batch), tokens per CPU-second (CPU time summed over ranks: a figure that other processes on
the machine disturb much less than wall time), MFU, and padding: the share of the tokens that the workers'
micro-batches processed which were padding (mppo.workers.batching.TOKEN_COUNTER).

MFU = model FLOPs of the step (mppo.trainer.model_flops: 2 x params per token per forward, 6 per update) over
(step seconds x the peak of the cores the run uses). The peak is measured here, before each launch: the best of a
few fp32 2048 x 2048 matmuls on one thread, in FLOP per CPU-second of that thread (so other processes running at
the same time do not lower it), times the cores the run uses (ranks x threads per rank, at most the cores).
"MFU per CPU-second" divides the same FLOPs by (CPU-seconds of all ranks x the one-thread peak): how well the
cycles the run got were used, whatever else ran on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from mppo.bench.fresh_process import REPO, run_torchrun

DEFAULT_CONFIG = REPO / "configs" / "demo_cpu.yaml"
CACHE = Path(os.environ.get("MPPO_BENCH_CACHE", Path.home() / ".cache" / "mppo-bench"))
ESTIMATORS = {"gae": "PPO (GAE + critic)", "grpo": "GRPO"}
ACTOR_KEYS = ("actor/lr", "actor/grad_norm", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac")
PHASES = ("weight_sync", "gen", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "step")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] key=value",
                   help="config (default configs/demo_cpu.yaml) and overrides, applied after the bench's own")
    p.add_argument("--estimators", default="gae,grpo", help="comma list of gae (PPO + critic) and grpo")
    p.add_argument("--nproc", type=int, default=1, help="ranks (torchrun processes)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (with --experts)")
    p.add_argument("--experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many experts (top-2)")
    p.add_argument("--threads-per-rank", type=int, default=0, help="torch threads per rank (0: cores / nproc)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="prompts per step (data.train_batch_size)")
    p.add_argument("--n", type=int, default=4, help="GRPO group size (PPO uses 1 sample per prompt)")
    p.add_argument("--mini-batches", type=int, default=2,
                   help="optimizer steps per update (1: on-policy, the old log-probs come from the update's forward)")
    p.add_argument("--response-length", type=int, default=64, help="data.max_response_length")
    p.add_argument("--eos-prob", type=float, default=0.0,
                   help="per-token stop probability of the random model (0: 2 / response length)")
    p.add_argument("--token-budget", type=int, default=2048,
                   help="ppo_max_token_len_per_gpu with use_dynamic_bsz (0: micro-batches of 4 rows by count)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--json", type=Path, default=None, help="also write all measurements here")
    return p


# ------------------------------------------------------------------------------------------------ machine
def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> float:
    """1-minute load average (`uptime`): other processes competing for the cores during a measurement."""
    return os.getloadavg()[0]


def matmul_peak_per_cpu_second(n: int = 2048, repeats: int = 5) -> float:
    """fp32 FLOP per CPU-second of one thread: the best of `repeats` n x n matmuls, timed in this process's CPU
    time (a thread that other processes preempt loses wall time, not CPU time)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            a @ b
            best = min(best, time.process_time() - start)
        return 2 * n ** 3 / best
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ one run
def run_spec(opts: argparse.Namespace, estimator: str, assets: Path, run_dir: Path) -> dict[str, Any]:
    """What one torchrun launch needs: config, overrides and the measurement schedule."""
    from mppo.bench.assets import bench_overrides

    items = list(opts.items)
    config = items.pop(0) if items and "=" not in items[0] else str(DEFAULT_CONFIG)
    n = opts.n if estimator == "grpo" else 1
    world = opts.nproc
    dp = world // (opts.tp * opts.pp)
    overrides = bench_overrides(assets, run_dir, world=world, batch=opts.batch,
                                response_length=opts.response_length, estimator=estimator, n=n)
    mini = max(dp, opts.batch // opts.mini_batches)  # optimizer steps per update
    overrides += [f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={opts.tp}",
                  f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={opts.pp}",
                  f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={opts.ep}",
                  f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}"]
    if opts.token_budget:
        overrides += ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                      f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={opts.token_budget}",
                      f"critic.ppo_max_token_len_per_gpu={opts.token_budget}"]
    else:
        overrides += ["actor_rollout_ref.actor.use_dynamic_bsz=false",
                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                      "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    overrides += [item for item in items if "=" in item]
    return {"config": config, "overrides": overrides, "warmup": opts.warmup, "steps": opts.steps,
            "repeats": opts.repeats}


def launch(spec: dict[str, Any], nproc: int, threads: int, out_dir: Path, timeout_s: float = 3600) -> dict:
    """One torchrun launch of this module's rank entry point; returns rank 0's measurements."""
    spec_path, out_path = out_dir / "spec.json", out_dir / "result.json"
    spec_path.write_text(json.dumps({**spec, "threads": threads, "out": str(out_path)}))
    load_before = load_average()
    run_torchrun("mppo.bench.step", ["--rank-worker", str(spec_path)], nproc=nproc, threads=threads,
                 timeout_s=timeout_s, expect=out_path)
    result = json.loads(out_path.read_text())
    result["load"] = {"before": load_before, "after": load_average()}
    return result


# ------------------------------------------------------------------------------------------------ ranks
def _batches(loader) -> Iterator[Any]:
    while True:
        yield from loader


def rank_main(spec_path: str) -> None:
    """Build the trainer from the spec's config and time `warmup + steps x repeats` train steps."""
    import logging
    import warnings

    spec = json.loads(Path(spec_path).read_text())
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(spec["threads"])
    import torch.distributed as dist

    from mppo.config import load_config
    from mppo.trainer.fit import PPOTrainer
    from mppo.workers.batching import TOKEN_COUNTER

    cfg = load_config(spec["config"], spec["overrides"], world_size=int(os.environ["WORLD_SIZE"]))
    trainer = PPOTrainer(cfg)
    batches = _batches(trainer.data.train_loader)
    steps: list[dict[str, Any]] = []
    for index in range(spec["warmup"] + spec["steps"] * spec["repeats"]):
        TOKEN_COUNTER.reset()
        cpu_start = time.process_time()
        metrics = trainer.train_step(next(batches))
        cpu_seconds = time.process_time() - cpu_start
        trainer.step += 1
        counts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(counts, {"cpu": cpu_seconds, **{k: vars(v) for k, v in TOKEN_COUNTER.phases.items()}})
        cpu_seconds = sum(c.pop("cpu") for c in counts)
        padding: dict[str, dict[str, int]] = {}
        for rank_counts in counts:
            for phase, c in rank_counts.items():
                entry = padding.setdefault(phase, {"real": 0, "processed": 0, "micro_batches": 0})
                for key in entry:
                    entry[key] += c[key]
        tokens = metrics["perf/total_num_tokens"]
        steps.append({
            "warmup": index < spec["warmup"],
            "seconds": {p: metrics[f"timing_s/{p}"] for p in PHASES if f"timing_s/{p}" in metrics},
            "tokens": tokens, "cpu_seconds": cpu_seconds, "response_length": metrics["response_length/mean"],
            "response_length_max": metrics["response_length/max"],
            "response_length_min": metrics["response_length/min"],
            "score": metrics.get("critic/score/mean"), "padding": padding,
            "actor": {k: metrics[k] for k in ACTOR_KEYS if k in metrics},
            "flops": trainer.step_flops})  # the trainer's own count for its perf/mfu (mppo.trainer.model_flops)
    if dist.get_rank() == 0:
        info = {"num_parameters": trainer.num_parameters, "world": trainer.dims.world,
                "layout": {"tp": trainer.dims.tp, "pp": trainer.dims.pp, "dp": trainer.dims.dp},
                "threads": torch.get_num_threads(), "steps": steps}
        Path(spec["out"]).write_text(json.dumps(info))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ summary
def summarize(result: dict[str, Any], repeats: int, peak: float, peak_cpu: float) -> dict[str, Any]:
    """Medians over repeats of per-repeat means: seconds per phase, tokens/s, MFU; padding over measured steps."""
    measured = [s for s in result["steps"] if not s["warmup"]]
    per = max(1, len(measured) // repeats)
    blocks = [measured[i:i + per] for i in range(0, per * repeats, per)]
    phases = [p for p in PHASES if any(p in s["seconds"] for s in measured)]

    def block_stat(fn) -> float:
        return statistics.median(fn(b) for b in blocks)

    seconds = {p: block_stat(lambda b, p=p: sum(s["seconds"].get(p, 0.0) for s in b) / len(b)) for p in phases}
    tokens_per_s = block_stat(lambda b: sum(s["tokens"] for s in b) / sum(s["seconds"]["step"] for s in b))
    tokens_per_cpu_s = block_stat(lambda b: sum(s["tokens"] for s in b) / sum(s["cpu_seconds"] for s in b))
    mfu = block_stat(lambda b: sum(s["flops"] for s in b) / (sum(s["seconds"]["step"] for s in b) * peak))
    mfu_cpu = block_stat(lambda b: sum(s["flops"] for s in b) / (sum(s["cpu_seconds"] for s in b) * peak_cpu))
    padding: dict[str, dict[str, float]] = {}
    for s in measured:
        for phase, c in s["padding"].items():
            entry = padding.setdefault(phase, {"real": 0, "processed": 0, "micro_batches": 0})
            for key in entry:
                entry[key] += c[key]
    total = {k: sum(e[k] for e in padding.values()) for k in ("real", "processed", "micro_batches")}
    padding["all"] = total
    for entry in padding.values():
        entry["padding_fraction"] = 1 - entry["real"] / entry["processed"] if entry["processed"] else 0.0
    lengths = [s["response_length"] for s in measured]
    return {"seconds": seconds, "tokens_per_s": tokens_per_s, "tokens_per_cpu_s": tokens_per_cpu_s, "mfu": mfu,
            "mfu_cpu": mfu_cpu,
            "padding": padding,
            "tokens_per_step": statistics.mean(s["tokens"] for s in measured),
            "response_length": {"mean": statistics.mean(lengths),
                                "min": min(s["response_length_min"] for s in measured),
                                "max": max(s["response_length_max"] for s in measured)}}


def render(summaries: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    head = f"{'median seconds per step':<28}" + "".join(f"{ESTIMATORS[n]:>22}" for n in names)
    lines = [head, "-" * len(head)]
    for phase in PHASES:
        if any(phase in s["seconds"] for s in summaries.values()):
            cells = "".join(f"{summaries[n]['seconds'][phase]:>22.3f}" if phase in summaries[n]["seconds"]
                            else f"{'-':>22}" for n in names)
            lines.append(f"  {phase:<26}" + cells)
    rows = (("tokens per step", lambda s: f"{s['tokens_per_step']:.0f}"),
            ("response length mean [min, max]", lambda s: "{mean:.1f} [{min:.0f}, {max:.0f}]".format(
                **s["response_length"])),
            ("tokens/s (prompt + response)", lambda s: f"{s['tokens_per_s']:.0f}"),
            ("tokens per CPU-second", lambda s: f"{s['tokens_per_cpu_s']:.0f}"),
            ("MFU (vs measured fp32 peak)", lambda s: f"{s['mfu']:.1%}"),
            ("MFU per CPU-second", lambda s: f"{s['mfu_cpu']:.1%}"),
            ("padding, all phases", lambda s: f"{s['padding']['all']['padding_fraction']:.2%}"))
    for label, fn in rows:
        lines.append(f"{label:<28}" + "".join(f"{fn(summaries[n]):>22}" for n in names))
    lines.append("")
    lines.append("padding by phase (padded / processed tokens, micro-batches):")
    for n in names:
        parts = [f"{phase} {e['padding_fraction']:.1%} ({e['micro_batches']})"
                 for phase, e in summaries[n]["padding"].items() if phase != "all"]
        lines.append(f"  {ESTIMATORS[n]}: " + ", ".join(parts))
    return "\n".join(lines)


def bench_assets(hidden: int, layers: int, eos_prob: float, experts: int = 0) -> Path:
    from mppo.bench.assets import ModelSize, make_bench_assets

    size = ModelSize(hidden=hidden, layers=layers, eos_probability=eos_prob, experts=experts)
    root = CACHE / (f"assets-h{hidden}-l{layers}-eos{eos_prob:.4f}" + (f"-moe{experts}" if experts else ""))
    return make_bench_assets(root, size=size)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    """Measure every requested estimator; returns the raw results and their summaries."""
    estimators = [e.strip() for e in opts.estimators.split(",") if e.strip()]
    unknown = [e for e in estimators if e not in ESTIMATORS]
    if unknown or not estimators:
        raise ValueError(f"--estimators takes a comma list of {sorted(ESTIMATORS)}, got {opts.estimators!r}")
    if min(opts.nproc, opts.tp, opts.pp, opts.steps, opts.repeats, opts.batch, opts.n) < 1 or opts.warmup < 0:
        raise ValueError("--nproc, --tp, --pp, --steps, --repeats, --batch and --n must be >= 1, --warmup >= 0")
    if opts.mini_batches < 1 or opts.batch % opts.mini_batches:
        raise ValueError(f"--mini-batches must be >= 1 and divide --batch {opts.batch}, got {opts.mini_batches}")
    if opts.nproc % (opts.tp * opts.pp):
        raise ValueError(f"--nproc {opts.nproc} must be a multiple of --tp x --pp = {opts.tp * opts.pp}")
    if opts.ep < 1 or (opts.nproc // (opts.tp * opts.pp)) % opts.ep or (opts.ep > 1 and not opts.experts):
        raise ValueError(f"--ep {opts.ep} needs --experts and must divide the data-parallel size "
                         f"--nproc / (--tp x --pp) = {opts.nproc // (opts.tp * opts.pp)}")
    cores = cpu_cores()
    threads = opts.threads_per_rank or max(1, cores // opts.nproc)
    eos_prob = opts.eos_prob or min(0.5, 2.0 / opts.response_length)
    assets = bench_assets(opts.hidden, opts.layers, eos_prob, opts.experts)
    peak_threads = min(cores, opts.nproc * threads)
    out: dict[str, Any] = {"cores": cores, "threads_per_rank": threads, "peak_threads": peak_threads,
                           "eos_prob": eos_prob, "assets": str(assets), "results": {}, "summaries": {}}
    with tempfile.TemporaryDirectory(prefix="mppo-bench-step-") as tmp:
        for estimator in estimators:
            # the peak is measured right before each launch, under the same load as the run
            peak_cpu = matmul_peak_per_cpu_second()
            peak = peak_cpu * peak_threads
            work = Path(tmp) / estimator
            work.mkdir()
            spec = run_spec(opts, estimator, assets, work / "run")
            result = launch(spec, opts.nproc, threads, work)
            result.update(peak_flops=peak, peak_flops_per_cpu_s=peak_cpu, overrides=spec["overrides"])
            out["results"][estimator] = result
            out["summaries"][estimator] = summarize(result, opts.repeats, peak, peak_cpu)
    return out


def describe(opts: argparse.Namespace, out: dict[str, Any]) -> str:
    first = next(iter(out["results"].values()))
    layout = first["layout"]
    peaks = ", ".join(f"{ESTIMATORS[e]} {r['peak_flops'] / 1e9:.1f}" for e, r in out["results"].items())
    loads = ", ".join(f"{ESTIMATORS[e]} {r['load']['before']:.2f} -> {r['load']['after']:.2f}"
                      for e, r in out["results"].items())
    micro = (f"token budget {opts.token_budget} tokens per micro-batch (use_dynamic_bsz)" if opts.token_budget
             else "4 rows per micro-batch (by count)")
    return "\n".join([
        f"mppo bench step: random {f'Qwen3-MoE ({opts.experts} experts, top-2, EP{opts.ep})' if opts.experts else 'Qwen2'}"
        f" (hidden {opts.hidden}, {opts.layers} layers, "
        f"{first['num_parameters'] / 1e6:.2f}M parameters, fp32), countdown prompts, responses <= "
        f"{opts.response_length} tokens (stop probability {out['eos_prob']:.3f} per token)",
        f"layout: TP{layout['tp']} PP{layout['pp']} DP{layout['dp']} = {first['world']} rank(s) x "
        f"{out['threads_per_rank']} thread(s) on {out['cores']} cores; {opts.batch} prompts per step (GRPO: x "
        f"{opts.n}); {micro}",
        f"steps: {opts.warmup} warm-up, then {opts.repeats} repeats x {opts.steps} steps; medians over repeats",
        f"fp32 matmul peak (2048^2, best of 5, one thread, GFLOP per CPU-second) x {out['peak_threads']} core(s) "
        f"used, GFLOP/s: {peaks}",
        f"load average (uptime, 1 min) before -> after: {loads}",
    ])


def run_and_report(name: str, opts: argparse.Namespace, run_fn, describe_fn, render_fn) -> int:
    """A step-style bench's CLI: run it, print its description and table, write --json; a bad option is exit 2."""
    try:
        out = run_fn(opts)
    except ValueError as err:
        print(f"mppo bench {name}: {err}", file=sys.stderr)
        return 2
    print(describe_fn(opts, out) + "\n")
    print(render_fn(out["summaries"]))
    if opts.json:
        opts.json.write_text(json.dumps({"options": vars(opts) | {"json": str(opts.json)}, **out}, indent=1,
                                        default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_and_report("step", _parser().parse_args(argv), run, describe, render)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_main(sys.argv[2])
    else:
        sys.exit(main())
