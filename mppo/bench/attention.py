"""`mppo bench attention`: peak extra memory and time of a decoder's forward + backward at long sequence lengths,
megatron-core's local attention spec (DotProductAttention: [heads, s, s] scores and probabilities) against mppo's
SDPA spec (`torch.nn.functional.scaled_dot_product_attention`: the flash kernel on CPU, flash / memory-efficient /
cuDNN on CUDA), side by side in one run.

The model is a random Qwen2-shaped megatron GPTModel built by mppo's builder (`build_gpt_model`, the real spec
path), run on one sequence of L tokens with its output layer skipped: the loss is Σ random · final hidden states,
so the vocabulary projection (the log-prob kernel's business, `mppo bench kernels`) does not hide the attention.
Every (L, implementation) case runs in a FRESH subprocess (mppo.bench.fresh_process), so allocator caches and
high-water marks never leak from one case into the next, and `--runs` repeats the whole sweep with the two
implementations in alternating order (the machine may be shared: CPU time is reported beside the wall clock, and the
minimum over runs).
Memory method, as in `mppo bench kernels`:
  * CPU: the process's peak resident set size (getrusage ru_maxrss) minus its RSS after the model and inputs were
    built, minus the bytes of the parameter gradients (the same for both), measured on the first forward + backward;
  * CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before the first forward + backward, minus the
    gradients.
Time: wall clock and process CPU time of forward + backward, minimum over `--repeats` runs after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from mppo.bench.fresh_process import peak_rss_bytes, run_case, write_results

IMPLS = ("sdpa", "local")
FULL_LENGTHS = (1024, 4096, 8192)
QUICK_LENGTHS = (128, 256)


def worker(impl: str, length: int, opts: argparse.Namespace) -> dict:
    """Build the model in this (fresh) process, run forward + backward 1 + repeats times, return the measurements."""
    import psutil
    import torch

    from mppo.models.builders import build_gpt_model
    from mppo.models.hf_config import read_hf_config
    from mppo.parallel import destroy, init_distributed

    dims = init_distributed(1, 1, seed=0)
    cuda = dims.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    args = read_hf_config({"model_type": "qwen2", "hidden_size": opts.hidden, "intermediate_size": 3 * opts.hidden,
                           "num_hidden_layers": opts.layers, "num_attention_heads": opts.heads,
                           "num_key_value_heads": opts.kv_heads, "vocab_size": 1024,
                           "max_position_embeddings": length, "tie_word_embeddings": False})
    model = build_gpt_model(args, dims, transformer_impl=impl, dtype=dtype)[0]
    model.post_process = False  # return the final hidden states [s, 1, h]; no output layer
    core_attention = type(model.decoder.layers[0].self_attention.core_attention).__name__
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (1, length), generator=gen).to(dims.device)
    positions = torch.arange(length, device=dims.device)[None]
    upstream = torch.randn(length, 1, opts.hidden, generator=gen).to(dims.device)

    def forward_backward() -> float:
        model.zero_grad(set_to_none=True)
        hidden = model(ids, positions, None)
        loss = (hidden.float() * upstream).sum()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        return float(loss.detach())

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = psutil.Process().memory_info().rss
    loss = forward_backward()  # the memory run
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_rss_bytes()
    times, cpu_times = [], []
    for _ in range(opts.repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        forward_backward()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    destroy(process_group=True)
    return {"impl": impl, "length": length, "device": dims.device.type, "dtype": str(dtype).replace("torch.", ""),
            "core_attention": core_attention, "time_s": min(times), "cpu_s": min(cpu_times),
            "extra_bytes": peak - base - grad_bytes, "loss": loss}


def _launch(impl: str, length: int, opts: argparse.Namespace) -> dict:
    args = [impl, "--length", str(length), "--layers", str(opts.layers), "--hidden", str(opts.hidden),
            "--heads", str(opts.heads), "--kv-heads", str(opts.kv_heads), "--repeats", str(opts.repeats)]
    return run_case("mppo.bench.attention", args, case={"impl": impl, "length": length}, timeout=opts.timeout,
                    threads=opts.threads, hide_gpus=opts.device == "cpu")


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (length, impl): the minimum time, CPU time and memory over the runs that did not fail."""
    rows: dict[tuple[int, str], dict] = {}
    for r in runs:
        key = (r["length"], r["impl"])
        row = rows.setdefault(key, {"length": r["length"], "impl": r["impl"], "runs": 0, "errors": []})
        if "error" in r:
            row["errors"].append(r["error"])
            continue
        row["runs"] += 1
        for field in ("time_s", "cpu_s", "extra_bytes"):
            row[field] = min(row.get(field, float("inf")), r[field])
        row["loss"] = r["loss"]
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], IMPLS.index(k[1]) if k[1] in IMPLS else 9))]


def table(rows: list[dict]) -> str:
    header = (f"| {'L':>5} | {'impl':<5} | {'runs':>4} | {'time s':>8} | {'cpu s':>8} | {'cpu/local':>9} | "
              f"{'extra MiB':>10} | {'mem/local':>9} | {'loss rel.diff':>13} |")
    lines = [header, "|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|"]
    local = {r["length"]: r for r in rows if r["impl"] == "local" and r["runs"]}
    for r in rows:
        if not r["runs"]:
            lines.append(f"| {r['length']:>5} | {r['impl']:<5} | {0:>4} | {r['errors'][0]}")
            continue
        base = local.get(r["length"])
        cpu = f"{r['cpu_s'] / base['cpu_s']:.2f}x" if base and base["cpu_s"] > 0 else "-"
        mem = f"{r['extra_bytes'] / base['extra_bytes']:.3f}x" if base and base["extra_bytes"] > 0 else "-"
        diff = f"{abs(r['loss'] - base['loss']) / abs(base['loss']):.1e}" if base else "-"
        lines.append(f"| {r['length']:>5} | {r['impl']:<5} | {r['runs']:>4} | {r['time_s']:>8.3f} | "
                     f"{r['cpu_s']:>8.2f} | {cpu:>9} | {r['extra_bytes'] / 2 ** 20:>10.1f} | {mem:>9} | {diff:>13} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mppo bench attention", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"smoke run: L in {QUICK_LENGTHS}, one run")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--lengths", default=None, help=f"comma-separated sequence lengths (default {FULL_LENGTHS})")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset of " + ",".join(IMPLS))
    p.add_argument("--layers", type=int, default=1, help="decoder layers (default 1)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4, head dim = hidden / heads)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--runs", type=int, default=None, help="sweeps, implementations alternating (default 3, quick 1)")
    p.add_argument("--repeats", type=int, default=2, help="timed forward+backward per process after the first")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the workers")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per case before it is reported failed")
    p.add_argument("--json", default=None, help="also write every run's raw result to this file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    opts = _parser().parse_args(argv)
    if opts.device == "auto":
        import torch
        opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.worker:
        print(json.dumps(worker(opts.worker, opts.length, opts)))
        return 0
    impls = [i.strip() for i in opts.impls.split(",") if i.strip()]
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        print(f"unknown implementation(s) {unknown}; choose from {IMPLS}", file=sys.stderr)
        return 2
    if opts.hidden % opts.heads or opts.heads % opts.kv_heads:
        print("--heads must divide --hidden and --kv-heads must divide --heads", file=sys.stderr)
        return 2
    lengths = ([int(x) for x in opts.lengths.split(",")] if opts.lengths
               else list(QUICK_LENGTHS if opts.quick else FULL_LENGTHS))
    n_runs = opts.runs if opts.runs is not None else (1 if opts.quick else 3)
    threads = opts.threads or os.environ.get("OMP_NUM_THREADS", "default")
    print(f"mppo bench attention: device={opts.device}, layers={opts.layers}, hidden={opts.hidden}, "
          f"heads={opts.heads}/{opts.kv_heads} kv, runs={n_runs}, repeats={opts.repeats}, threads={threads}",
          flush=True)
    results = []
    for run in range(n_runs):
        order = impls if run % 2 == 0 else impls[::-1]
        for length in lengths:
            for impl in order:
                r = _launch(impl, length, opts)
                r["run"] = run
                results.append(r)
                status = r.get("error") or (f"{r['time_s']:.3f}s wall, {r['cpu_s']:.2f}s cpu, "
                                            f"extra {r['extra_bytes'] / 2 ** 20:.1f} MiB ({r['core_attention']})")
                print(f"  run {run} {impl:<5} L={length:<6} {status}", flush=True)
    print(table(summarise(results)))
    write_results(opts.json, results)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
