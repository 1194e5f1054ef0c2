"""`mppo bench scaling`: tokens/s of whole RL steps against batch size, response length and parallel layout on CPU.

Each point is one `mppo bench step` measurement (its own torchrun launch, warm-up excluded). Three sweeps around
a base point (GRPO, --base-batch prompts, --base-length response tokens, TP1 on one rank with every core):
batch size, response length (the random model's stop probability is 2 / length, so responses grow with the
limit), and layout (TP1 | TP2 | PP2 | DP2, every layout on all cores). Writes a Markdown table, a PNG, and for
each phase the exponent k of its seconds ~ x^k between the sweep's ends: how that cost grows.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from mppo.bench import step as bench_step

# layout name -> (ranks, tp, pp); ranks / (tp x pp) = DP
LAYOUTS = {"tp1": (1, 1, 1), "tp2": (2, 2, 1), "pp2": (2, 1, 2), "dp2": (2, 1, 1)}
COST_PHASES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "step")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--estimator", default="grpo", choices=sorted(bench_step.ESTIMATORS))
    p.add_argument("--batches", type=_ints, default=[4, 8, 16, 32], help="prompts per step")
    p.add_argument("--lengths", type=_ints, default=[32, 64, 128, 256], help="max response lengths")
    p.add_argument("--layouts", default="tp1,tp2,pp2,dp2")
    p.add_argument("--base-batch", type=int, default=8)
    p.add_argument("--base-length", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="GRPO group size")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--png", type=Path, default=Path("bench/scaling.png"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables here")
    return p


def point(opts: argparse.Namespace, *, batch: int, length: int, layout: str) -> dict[str, Any]:
    ranks, tp, pp = LAYOUTS[layout]
    argv = ["--estimators", opts.estimator, "--nproc", str(ranks), "--tp", str(tp), "--pp", str(pp),
            "--batch", str(batch), "--response-length", str(length), "--n", str(opts.n),
            "--warmup", str(opts.warmup), "--steps", str(opts.steps), "--repeats", str(opts.repeats),
            "--hidden", str(opts.hidden), "--layers", str(opts.layers)]
    out = bench_step.run(bench_step._parser().parse_args(argv))
    summary = out["summaries"][opts.estimator]
    result = out["results"][opts.estimator]
    print(f"  {layout} batch {batch} length {length}: {summary['tokens_per_s']:.0f} tokens/s "
          f"(load {result['load']['before']:.1f})", flush=True)
    return {"batch": batch, "length": length, "layout": layout, "tokens_per_s": summary["tokens_per_s"],
            "tokens_per_cpu_s": summary["tokens_per_cpu_s"], "mfu": summary["mfu"], "mfu_cpu": summary["mfu_cpu"], "seconds": summary["seconds"], "tokens_per_step": summary["tokens_per_step"],
            "response_length": summary["response_length"]["mean"],
            "padding": summary["padding"]["all"]["padding_fraction"], "load": result["load"],
            "peak_flops": result["peak_flops"]}


def growth(points: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per phase, k in seconds ~ x^k between the first and last point of a sweep (x = its `key`)."""
    first, last = points[0], points[-1]
    ratio = math.log(last[key] / first[key])
    return {p: math.log(last["seconds"][p] / first["seconds"][p]) / ratio for p in COST_PHASES
            if p in first["seconds"] and first["seconds"][p] > 0 and last["seconds"].get(p, 0) > 0}


def table(points: list[dict[str, Any]], label: str, key: str) -> str:
    phases = [p for p in COST_PHASES if p in points[0]["seconds"]]
    head = (f"| {label} | tokens/step | mean response | tokens/s | tokens/CPU-s | MFU | MFU/CPU-s | padding | "
            + " | ".join(f"{p} s" for p in phases) + " | load |")
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for pt in points:
        lines.append(f"| {pt[key]} | {pt['tokens_per_step']:.0f} | {pt['response_length']:.1f} | "
                     f"{pt['tokens_per_s']:.0f} | {pt['tokens_per_cpu_s']:.0f} | {pt['mfu']:.1%} | "
                     f"{pt['mfu_cpu']:.1%} | {pt['padding']:.1%} | "
                     + " | ".join(f"{pt['seconds'].get(p, 0):.3f}" for p in phases)
                     + f" | {pt['load']['before']:.1f} |")
    return "\n".join(lines)


def growth_line(points: list[dict[str, Any]], axes: list[tuple[str, str]]) -> str:
    """Exponents of each phase's seconds against each (label, key) of `axes`: the swept setting, and what the
    step actually processed (tokens per step; the mean response length, i.e. decode steps)."""
    if len(points) < 2:
        return ""
    lines = []
    for label, x in axes:
        k = growth(points, x)
        lines.append(f"seconds ~ ({label})^k, {points[0][x]:.0f} -> {points[-1][x]:.0f}: "
                     + ", ".join(f"{p} {v:.2f}" for p, v in k.items()))
    return "\n".join(lines)


def plot(path: Path, sweeps: dict[str, list[dict[str, Any]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for col, (name, key, xlabel) in enumerate((("batch", "batch", "prompts per step"),
                                               ("length", "length", "max response length"))):
        pts = sweeps[name]
        if not pts:
            continue
        x = [p[key] for p in pts]
        axes[0, col].plot(x, [p["tokens_per_s"] for p in pts], marker="o", label="tokens/s (wall)")
        axes[0, col].plot(x, [p["tokens_per_cpu_s"] for p in pts], marker="s", linestyle="--",
                          label="tokens per CPU-second")
        axes[0, col].set(title=f"throughput vs {xlabel}", xscale="log", xlabel=xlabel)
        axes[0, col].legend(fontsize=7)
        for phase in COST_PHASES:
            ys = [p["seconds"].get(phase) for p in pts]
            if all(y for y in ys):
                axes[1, col].plot(x, ys, marker="o", markersize=3, label=phase)
        axes[1, col].set(title=f"seconds per step by phase vs {xlabel}", xscale="log", yscale="log", xlabel=xlabel)
        axes[1, col].legend(fontsize=7)
        for ax in axes[:, col]:
            ax.set_xticks(x, [str(v) for v in x])
            ax.minorticks_off()
    pts = sweeps["layout"]
    if pts:
        names = [p["layout"].upper() for p in pts]
        axes[0, 2].bar(names, [p["tokens_per_s"] for p in pts], label="tokens/s (wall)")
        axes[0, 2].plot(names, [p["tokens_per_cpu_s"] for p in pts], "ks--", label="tokens per CPU-second")
        axes[0, 2].set(title="throughput by layout (all cores)")
        axes[0, 2].legend(fontsize=7)
        bottom = [0.0] * len(pts)
        for phase in COST_PHASES[:-1]:
            ys = [p["seconds"].get(phase, 0.0) for p in pts]
            if any(ys):
                axes[1, 2].bar(names, ys, bottom=bottom, label=phase)
                bottom = [b + y for b, y in zip(bottom, ys)]
        axes[1, 2].set(title="seconds per step by phase, by layout")
        axes[1, 2].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    layouts = [x.strip().lower() for x in opts.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        print(f"mppo bench scaling: unknown layouts {unknown}; choose from {sorted(LAYOUTS)}", file=sys.stderr)
        return 2
    base = {"batch": opts.base_batch, "length": opts.base_length, "layout": "tp1"}
    cache: dict[tuple, dict[str, Any]] = {}

    def measure(**kw) -> dict[str, Any]:
        key = (kw["batch"], kw["length"], kw["layout"])
        if key not in cache:
            cache[key] = point(opts, **kw)
        return cache[key]

    print(f"mppo bench scaling ({bench_step.ESTIMATORS[opts.estimator]}):", flush=True)
    sweeps = {"batch": [measure(**{**base, "batch": b}) for b in opts.batches],
              "length": [measure(**{**base, "length": t}) for t in opts.lengths],
              "layout": [measure(**{**base, "layout": name}) for name in layouts]}
    text = "\n\n".join([
        table(sweeps["batch"], "prompts/step", "batch"),
        growth_line(sweeps["batch"], [("prompts/step", "batch"), ("tokens/step", "tokens_per_step")]),
        table(sweeps["length"], "max response", "length"),
        growth_line(sweeps["length"], [("max response", "length"), ("mean response", "response_length"),
                                       ("tokens/step", "tokens_per_step")]),
        table(sweeps["layout"], "layout", "layout")])
    print("\n" + text)
    plot(opts.png, sweeps)
    print(f"\nplot: {opts.png}")
    if opts.markdown:
        opts.markdown.write_text(text + "\n")
    if opts.json:
        opts.json.write_text(json.dumps({"options": {k: str(v) for k, v in vars(opts).items()}, "sweeps": sweeps},
                                        indent=1))
    return 0
