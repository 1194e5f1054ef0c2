"""`mppo bench off-policy`: step throughput of co-located, separate k=0, k=1, k=2 and k=1 partial-rollout GRPO on
long-tail lengths.

    mppo bench off-policy [key=value ...] [--warmup 1 --steps 4] [--cases colocated-1,colocated-2,k0,k1,k2,k1-partial]

Six launches of the real trainer (`fit`, as `mppo train` runs it) under torchrun, one thread per rank, on bench
assets made locally (mppo.bench.assets: countdown prompts, a random Qwen2 whose per-token stop probability makes
response lengths geometric, capped at data.max_response_length: a long tail whose longest response is ~4x the median
at the defaults, printed per run):

    colocated-1   1 rank that generates, then trains (the synchronous baseline, on half the cores)
    colocated-2   2 ranks (DP2) that each generate, then train, half the batch: the same cores as the split ones
    k0            1 trainer rank + 1 engine rank (actor_rollout_ref.hybrid_engine=false), synchronous
    k1            the same split, one-step off-policy (async_training.max_off_policy_steps=1): the engine generates
                  step s+1 while the trainer trains step s
    k2            the same split, two steps ahead (max_off_policy_steps=2): the engine generates steps s+1 and s+2
                  while the trainer trains step s
    k1-partial    k1 with partial rollouts (async_training.partial_rollout): step s's new weights interrupt the
                  generation of step s+1, whose tail goes on on them (fresher tokens, a re-prefill's cost)

Which is fair: colocated-2 against the split runs (both use 2 ranks, 2 threads): the split gives the engine and the
trainer one rank each where co-location gives both phases both ranks, so the split wins only by overlapping them.
colocated-1 shows what the split runs would be without a second rank.

Per case it prints the median over the measured steps of the step period (seconds from one training generation's
start to the next: everything a step costs, the pipeline's overlap included), the trainer's `timing_s/step`, and
tokens (prompt + response) per second of period, and the actor -> engine weight sync's rate (the trainer's side of
`perf/weight_sync_gb_per_s`: co-located, the export into the engine; separate, the export and the stream over the
bridge, after which the engine loads on its own); then each case's throughput over colocated-2's and colocated-1's.
Wall-clock figures: other processes on the machine slow them (the load average is printed).
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
from typing import Any

from mppo.bench.fresh_process import run_torchrun
from mppo.bench.step import DEFAULT_CONFIG, bench_assets, cpu_cores, load_average, run_and_report

SEPARATE = ["actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.nnodes=1"]
CASES = {  # name -> (ranks, trainer ranks, overrides)
    "colocated-1": (1, 1, []),
    "colocated-2": (2, 2, []),
    "k0": (2, 1, SEPARATE),
    "k1": (2, 1, SEPARATE + ["async_training.max_off_policy_steps=1"]),
    "k2": (2, 1, SEPARATE + ["async_training.max_off_policy_steps=2"]),
    "k1-partial": (2, 1, SEPARATE + ["async_training.max_off_policy_steps=1", "async_training.partial_rollout=true"]),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench off-policy", description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied after the bench's own")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    p.add_argument("--warmup", type=int, default=1, help="steps not measured (k1's first has nothing to overlap)")
    p.add_argument("--steps", type=int, default=4, help="measured steps")
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="GRPO group size")
    p.add_argument("--response-length", type=int, default=64, help="data.max_response_length")
    p.add_argument("--eos-prob", type=float, default=0.043,
                   help="per-token stop probability (median length ~ln2/p; the cap makes the tail)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: leave the GPUs visible (one per rank: 2 for every case but colocated-1)")
    p.add_argument("--json", type=Path, default=None, help="also write all measurements here")
    return p


# ------------------------------------------------------------------------------------------------ one launch
def case_overrides(opts: argparse.Namespace, case: str, assets: Path, run_dir: Path) -> list[str]:
    from mppo.bench.assets import bench_overrides

    _, trainer_ranks, extra = CASES[case]
    overrides = bench_overrides(assets, run_dir, world=trainer_ranks, batch=opts.batch,
                                response_length=opts.response_length, estimator="grpo", n=opts.n)
    # 2 optimizer steps per update: the old-log-prob pass runs, as it must off-policy
    # one trailing step: the last measured step's period ends where the next generation starts
    overrides += [f"trainer.total_training_steps={opts.warmup + opts.steps + 1}",
                  "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                  "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                  f"actor_rollout_ref.actor.ppo_mini_batch_size={max(trainer_ranks, opts.batch // 2)}",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"]
    return overrides + extra + list(opts.overrides)


def launch(overrides: list[str], ranks: int, work: Path, device: str = "cpu", timeout_s: float = 3600
           ) -> dict[str, Any]:
    """One torchrun launch of this module's rank entry point (the trainer's fit, generation calls timed)."""
    spec, out = work / "spec.json", work / "generations.json"
    spec.write_text(json.dumps({"config": str(DEFAULT_CONFIG), "overrides": overrides, "out": str(out)}))
    load_before = load_average()
    run_torchrun("mppo.bench.off_policy", ["--rank-worker", str(spec)], nproc=ranks, threads=1, timeout_s=timeout_s,
                 device=device, expect=out)
    result = json.loads(out.read_text())
    result["load"] = {"before": load_before, "after": load_average()}
    return result


def rank_main(spec_path: str) -> None:
    """What `mppo train` runs (mppo.trainer.fit.run), with the training generations' start times and response
    lengths recorded on the first trainer rank."""
    import logging
    import warnings

    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    from mppo.config import load_config
    from mppo.parallel.placement import ENGINE
    from mppo.trainer import offpolicy
    from mppo.trainer.fit import PPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = load_config(spec["config"], spec["overrides"], world_size=int(os.environ["WORLD_SIZE"]))
    side = offpolicy.start_side(cfg)
    if side is not None and side.role == ENGINE:
        offpolicy.run_engine_side(cfg, side)
        return
    trainer = PPOTrainer(cfg, side=side)
    calls: list[dict[str, Any]] = []
    generate = trainer.rollout.generate

    def timed_generate(prompts, sampling, **kwargs):
        start = time.time()
        responses = generate(prompts, sampling, **kwargs)
        calls.append({"start": start, "step": kwargs.get("step"), "prompt_tokens": sum(len(p) for p in prompts),
                      "lengths": [[r.prompt_index, len(r.token_ids)] for r in responses]})
        return responses

    trainer.rollout.generate = timed_generate
    trainer.fit()
    if trainer.is_main:
        rows = [json.loads(line) for line in trainer.metrics.path.read_text().splitlines() if line.strip()]
        Path(spec["out"]).write_text(json.dumps({"calls": calls, "metrics": rows}))


# ------------------------------------------------------------------------------------------------ summary
def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    calls, rows = result["calls"], {r["step"]: r for r in result["metrics"]}
    # the period of step i+1 (metrics' numbering): from its generation call to the next step's
    measured = calls[warmup:-1]
    periods = [b["start"] - a["start"] for a, b in zip(measured, calls[warmup + 1:])]
    tokens = [rows[c["step"] + 1]["perf/total_num_tokens"] for c in measured]
    lengths = [length for c in measured for _, length in c["lengths"]]
    groups: dict[tuple[int, int], list[int]] = {}
    for i, c in enumerate(measured):
        for prompt, length in c["lengths"]:
            groups.setdefault((i, prompt), []).append(length)
    group_mean = [statistics.mean(g) for g in groups.values()]
    steps = [c["step"] + 1 for c in measured]
    step_s = [rows[s]["timing_s/step"] for s in steps]
    period = statistics.median(periods)
    return {"period_s": period, "step_s": statistics.median(step_s),
            "tokens_per_s": statistics.median(t / p for t, p in zip(tokens, periods)),
            "tokens_per_step": statistics.mean(tokens),
            "staleness": statistics.mean(rows[s].get("async/staleness/mean", 0.0) for s in steps),
            "overlap_s": statistics.median(rows[s].get("async/gen_overlap_s", 0.0) for s in steps),
            "newer_tokens": statistics.mean(rows[s].get("async/partial/newer_token_fraction", 0.0) for s in steps),
            # the steps that synced (the trainer's side: export + send; across the split the engine loads after)
            "sync_gb_per_s": statistics.median([r["perf/weight_sync_gb_per_s"] for r in rows.values()
                                                if r.get("perf/weight_sync_bytes", 0) > 0] or [0.0]),
            "response_length": {"median": statistics.median(lengths), "max": max(lengths)},
            "group_mean_length": {"median": statistics.median(group_mean), "max": max(group_mean)}}


def render(summaries: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    head = f"{'':<34}" + "".join(f"{n:>14}" for n in names)
    rows = (("step period s (median)", lambda s: f"{s['period_s']:.2f}"),
            ("trainer timing_s/step (median)", lambda s: f"{s['step_s']:.2f}"),
            ("tokens per step", lambda s: f"{s['tokens_per_step']:.0f}"),
            ("tokens/s of period", lambda s: f"{s['tokens_per_s']:.1f}"),
            ("response length median / max", lambda s: "{median:.0f} / {max:.0f}".format(**s["response_length"])),
            ("group mean length median / max", lambda s: "{median:.0f} / {max:.0f}".format(
                **s["group_mean_length"])),
            ("async/staleness/mean", lambda s: f"{s['staleness']:.2f}"),
            ("async/gen_overlap_s (median)", lambda s: f"{s['overlap_s']:.2f}"),
            ("tokens on the newest weights", lambda s: f"{s['newer_tokens']:.2f}"),
            ("weight sync GB/s (median)", lambda s: f"{s['sync_gb_per_s']:.3f}"))
    lines = [head, "-" * len(head)] + [f"{label:<34}" + "".join(f"{fn(summaries[n]):>14}" for n in names)
                                       for label, fn in rows]
    for base in ("colocated-2", "colocated-1"):
        if base in summaries:
            cells = "".join(f"{summaries[n]['tokens_per_s'] / summaries[base]['tokens_per_s']:>13.2f}x"
                            for n in names)
            lines.append(f"{'throughput / ' + base:<34}" + cells)
    return "\n".join(lines)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    cases = [c.strip() for c in opts.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        raise ValueError(f"--cases takes a comma list of {', '.join(CASES)}, got {opts.cases!r}")
    if opts.warmup < 1 or opts.steps < 1 or opts.batch < 2 or opts.batch % 2 or opts.n < 1:
        raise ValueError("--warmup and --steps must be >= 1, --batch even and >= 2, --n >= 1")
    assets = bench_assets(opts.hidden, opts.layers, opts.eos_prob)
    out: dict[str, Any] = {"cores": cpu_cores(), "assets": str(assets), "results": {}, "summaries": {}}
    with tempfile.TemporaryDirectory(prefix="mppo-bench-off-policy-") as tmp:
        for case in cases:
            work = Path(tmp) / case
            work.mkdir()
            overrides = case_overrides(opts, case, assets, work / "run")
            result = launch(overrides, CASES[case][0], work, device=opts.device)
            result["overrides"] = overrides
            out["results"][case] = result
            out["summaries"][case] = summarize(result, opts.warmup)
    return out


def describe(opts: argparse.Namespace, out: dict[str, Any]) -> str:
    loads = ", ".join(f"{c} {r['load']['before']:.1f} -> {r['load']['after']:.1f}" for c, r in out["results"].items())
    return "\n".join([
        f"mppo bench off-policy: GRPO, random Qwen2 (hidden {opts.hidden}, {opts.layers} layers, fp32), "
        f"{opts.batch} countdown prompts x {opts.n} per step, responses <= {opts.response_length} tokens (stop "
        f"probability {opts.eos_prob:.3f} per token), CPU engine, 1 thread per rank on {out['cores']} cores"
        + (" (GPUs visible: --device cuda)" if opts.device == "cuda" else ""),
        f"steps: {opts.warmup} warm-up, {opts.steps} measured, 1 trailing (a step's period ends where the next "
        "step's generation starts)",
        f"load average (uptime, 1 min) before -> after: {loads}",
    ])


def main(argv: list[str] | None = None) -> int:
    return run_and_report("off-policy", _parser().parse_args(argv), run, describe, render)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-worker":
        rank_main(sys.argv[2])
    else:
        sys.exit(main())
